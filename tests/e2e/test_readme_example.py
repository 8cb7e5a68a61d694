"""The README's instrumentation example works as printed, and its demo text tells the demo's faults.

Covered: the first ```python block under the README heading that mentions
"Instrument" is run unchanged as a plain process (no torchrun) against a
real collector, configured only by RANKWATCH_COLLECTOR, RANKWATCH_TOKEN and
RANKWATCH_RUN_ID; afterwards the store holds one `step` row per step the
example runs (rank 0, with its loss) and the phases it names, once per step.
The paragraph on `make demo` names the faults `rankwatch demo` injects at its default length.
"""

import os
import re
import subprocess
import sys

from tests.support.otlp_payloads import query
from tests.support.paths import ROOT

README = ROOT / "README.md"
RUN = "run-readme"


def instrumentation_example() -> str:
    """The first python block after a heading containing "Instrument" (and before the next heading)."""
    text = README.read_text()
    heading = re.search(r"^#+ .*Instrument.*$", text, re.MULTILINE)
    assert heading, "README.md has no heading mentioning 'Instrument'"
    section = text[heading.end() :]
    following = re.search(r"^#+ ", section, re.MULTILINE)
    section = section[: following.start()] if following else section
    block = re.search(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert block, "no ```python block in README.md's instrumentation section"
    return block.group(1)


def test_readme_instrumentation_example(collector, tmp_path):
    code = instrumentation_example()
    loop = re.search(r"for \w+ in range\((\d+)\)", code)
    assert loop, "the example's training loop (for ... in range(N)) was not found"
    steps = int(loop.group(1))
    phases = sorted(set(re.findall(r"agent\.phase\(\"(\w+)\"\)", code)))
    assert phases, "the example times no phase"

    script = tmp_path / "readme_example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        RANKWATCH_COLLECTOR=collector.url, RANKWATCH_TOKEN=collector.token, RANKWATCH_RUN_ID=RUN, OMP_NUM_THREADS="1"
    )
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "unreachable" not in r.stderr and "never delivered" not in r.stderr, r.stderr
    collector.stop()

    rows = query(
        collector.db,
        "SELECT rank, step, count(*), any_value(loss) FROM steps WHERE run_id = ? GROUP BY ALL ORDER BY step",
        [RUN],
    )
    assert [(rank, step, count) for rank, step, count, _ in rows] == [(0, i, 1) for i in range(steps)]
    for _, step, _, loss in rows:
        assert loss is not None and loss > 0, (step, loss)
    assert query(collector.db, "SELECT count(*) FROM steps") == [(steps,)]
    assert query(collector.db, "SELECT run_id, world_size FROM runs") == [(RUN, 1)]

    ops = query(
        collector.db,
        "SELECT name, count(*), count(DISTINCT step) FROM ops WHERE run_id = ? "
        "AND kind = 'phase' GROUP BY name ORDER BY name",
        [RUN],
    )
    assert ops == [(name, steps, steps) for name in phases]
    if "tokens=" in code:
        tokens = int(re.search(r"tokens=(\d+)", code).group(1))
        assert query(collector.db, "SELECT DISTINCT tokens FROM steps WHERE run_id = ?", [RUN]) == [(tokens,)]


def test_readme_example_is_found():
    """Guards the extraction itself: the example initialises the agent, times steps and shuts down."""
    code = instrumentation_example()
    for call in ("agent.init(", "agent.step(", "agent.record(", "agent.shutdown("):
        assert call in code, call
    compile(code, "README.md", "exec")


def test_readme_tells_the_faults_the_demo_injects():
    """The fault specs the demo paragraph quotes, and the steps it names, are those of `rankwatch demo`'s
    default run (rankwatch/demo.py `faults`), so the text cannot drift from what the demo does."""
    from rankwatch.cli import build_parser
    from rankwatch.demo import faults

    steps = build_parser().parse_args(["demo"]).steps
    slow_from, spike_at, injected = faults(steps)
    text = README.read_text()
    paragraph = text[text.index("`make demo` starts") :].split("\n\n")[0]
    assert re.findall(r"`(?:--inject )?((?:straggler|spike):[^`]+)`", paragraph) == injected
    for told in (f"for {steps} steps", f"from step {slow_from}", f"spike at step {spike_at}"):
        assert re.search(r"\s+".join(told.split()), paragraph), told  # wherever the lines break
