"""verl's own Megatron launch scripts (tests/config/verl/corpus.json: verl's examples/ and
verl/experimental/*/shell/ at verl main of 2026-08-22, verl-recipe of 2026-08-05; each script run
with its defaults and its `python3 -m verl...` line captured by tools/verl_corpus.py) load as
`megarl config show` loads them. Every refusal left is listed with its reason in
tests/config/verl/corpus_refusals.json; a new one fails, and so does a listed one that is gone (so
the list stays exact). The counts are printed."""
import collections
import json
import logging
from pathlib import Path

from verl_corpus_load import CORPUS, launches, refusals

EXPECTED = Path(__file__).resolve().parent / "verl" / "corpus_refusals.json"


def test_corpus_is_verls_scripts_with_their_source_and_date():
    corpus = json.loads(CORPUS.read_text())
    assert {s["repo"]: s["date"] for s in corpus["sources"]} == {"verl-project/verl": "2026-08-22",
                                                                 "verl-project/verl-recipe": "2026-08-05"}
    assert all(s["commit"] and s["path"].endswith(".sh") for s in corpus["scripts"])
    lines = launches()
    assert len(lines) >= 50 and sum(len(s["args"]) for s in lines) > 4000
    # the entry points of issue 52 are all there
    assert {s["module"] for s in lines} >= {"verl.trainer.main_ppo", "verl.trainer.sft_trainer",
                                            "verl.experimental.fully_async_policy.fully_async_main",
                                            "verl.experimental.one_step_off_policy.main_ppo"}


def test_no_refusal_beyond_the_listed_ones(capsys):
    logging.disable(logging.WARNING)
    try:
        found = [r for entry in launches() for r in refusals(entry)]
    finally:
        logging.disable(logging.NOTSET)
    expected = json.loads(EXPECTED.read_text())["refusals"]
    listed = collections.Counter((e["script"], e["kind"], e["key"]) for e in expected)
    seen = collections.Counter(r.ident for r in found)
    args = sum(len(s["args"]) for s in launches())
    with capsys.disabled():
        kinds = collections.Counter(r.kind for r in found)
        print(f"\nverl corpus: {len(launches())} launch lines, {args} overrides; refused: {kinds['unknown']} as "
              f"unknown keys, {kinds['refused']} otherwise")
        for why, n in collections.Counter(e["reason"] for e in expected).most_common():
            print(f"  {n:4} {why}")
    new = [r for r in found if seen[r.ident] > listed[r.ident]]
    assert not new, "new refusals:\n" + "\n".join(f"{r.script}: {r.message}" for r in new)
    gone = [e for e in expected if listed[(e["script"], e["kind"], e["key"])] > seen[(e["script"], e["kind"], e["key"])]]
    assert not gone, "listed refusals that no longer happen (remove them from corpus_refusals.json):\n" + \
        "\n".join(f"{e['script']}: {e['key']}" for e in gone)
