"""Load the override lists of tests/config/verl/corpus.json (verl's launch scripts, as
tools/verl_corpus.py extracted them) the way `megarl config show` loads a command line, and name
every refusal: (script, kind, key). kind "unknown": the key is not known; "refused": the key is
known but its value (or the config as a whole, validation) is refused."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from megarl.config import ConfigError, load_config, validate
from megarl.config.args import experiment_file
from megarl.config.torchrun import layout_from_args
from megarl.config.verl_compat import SFT_MODULE, VERL_MODULES
from megarl.config.verl_groups import MLITE_LAUNCHER
from megarl.trainer.main_ppo import build_parser

CORPUS = Path(__file__).resolve().parent / "verl" / "corpus.json"

_OVERRIDE = re.compile(r"^override '(.+?)': |\(override '(.+?)'\)")
_FROM = re.compile(r"\[from override '(.+)'\]$")


@dataclass(frozen=True)
class Refusal:
    script: str  # repo path (and #launch index when a script launches more than once)
    kind: str  # "unknown" | "refused"
    key: str  # the override's key path, or the key path a validation line names
    message: str

    @property
    def ident(self) -> tuple[str, str, str]:
        return self.script, self.kind, self.key


def launches() -> list[dict]:
    """The corpus's launch lines (scripts that launch nothing are left out)."""
    return [s for s in json.loads(CORPUS.read_text())["scripts"] if s["module"] is not None]


def script_name(entry: dict) -> str:
    return entry["path"] + (f"#{entry['launch']}" if entry["launch"] else "")


def _key_of(text: str) -> str:
    return text.lstrip("+").partition("=")[0]


def refusals(entry: dict) -> list[Refusal]:
    """Every refusal of one launch line: load_config's per-override errors (each refused override
    is taken out and the rest loaded again, so that one bad key hides nothing), then validate's."""
    name = script_name(entry)
    module, argv = entry["module"], [a for a in entry["args"] if a != "-X"]
    if module == MLITE_LAUNCHER:  # verl_mlite/launch.py main(): runs argv[0] as __main__ with the rest
        module, argv = argv[0], argv[1:]
    entry = {**entry, "module": module}
    if entry["module"] not in VERL_MODULES:
        out = [Refusal(name, "refused", "module", f"{entry['module']}: not one of verl's entry points "
                       f"({', '.join(VERL_MODULES)}); megarl has no module of that name")]
    else:
        out = []
    args = build_parser().parse_intermixed_args(argv)
    try:
        config_file = experiment_file(args)
    except ConfigError as exc:
        out.append(Refusal(name, "refused", "--config-name", str(exc)))
        config_file = None
    defaults = VERL_MODULES[entry["module"]][1] if entry["module"] in VERL_MODULES else ()
    verl_sft = VERL_MODULES.get(entry["module"], ("",))[0] == SFT_MODULE  # verl's SFT keys (megarl.config.verl_sft)
    overrides = [*defaults, *args.overrides]
    if entry.get("launcher", [""])[0] == "torchrun":  # torchrun's layout, as megarl's driver reads it under torchrun
        overrides += layout_from_args(entry["launcher"][1:]).overrides()
    for _ in range(len(overrides) + 1):
        try:
            config = load_config(config_file, overrides, verl_sft)
            break
        except ConfigError as exc:
            dropped = set()
            for line in str(exc).splitlines()[1:]:
                line = line.strip().removeprefix("- ")
                m = _OVERRIDE.search(line)
                text = (m.group(1) or m.group(2)) if m else None
                if text is None and (m := _FROM.search(line)):
                    text = m.group(1)
                kind = "unknown" if "unknown key" in line else "refused"
                key = _key_of(text) if text else line.partition(":")[0].partition(" (")[0]
                out.append(Refusal(name, kind, key, line))
                if text in overrides:
                    dropped.add(text)
            if not dropped:
                return out
            overrides = [o for o in overrides if o not in dropped]
    try:
        validate(config, steps_from_data=verl_sft)  # SFT counts its steps from the data
    except ConfigError as exc:
        for line in str(exc).splitlines()[1:]:
            line = line.strip().removeprefix("- ")
            out.append(Refusal(name, "refused", line.partition(":")[0].partition(" ")[0], line))
    return out
