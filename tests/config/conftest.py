"""The config tests' shared helpers (`config_cases`) are imported by name."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
