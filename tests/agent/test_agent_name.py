"""The agent's import name: `rankwatch.agent`, so that a package of the user's own named `agent` stays theirs.

Covered, each in a fresh interpreter: a training script beside its own `agent` package, run zero-code
under `rankwatch run`, imports its own package and is instrumented all the same (every step stored); the
old import path `agent` still works for a deprecation window, saying so once (DeprecationWarning), and
its modules are the agent's own, not copies (one session, one class).
"""

import subprocess
import sys

from tests.support.commands import rankwatch_cli
from tests.support.otlp_payloads import query

SCRIPT = """
import torch
import agent  # the user's own package, beside this script

assert agent.WHOSE == "the user's", agent
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(agent.WHOSE)
"""

OLD_PATH = """
import warnings
warnings.simplefilter("error", DeprecationWarning)
try:
    import agent
except DeprecationWarning as e:
    print("warned:", e)
warnings.simplefilter("ignore", DeprecationWarning)
import agent
import agent.semconv
from agent.session import Session
import rankwatch.agent
import rankwatch.agent.semconv
import rankwatch.agent.session
print(agent is rankwatch.agent, agent.semconv is rankwatch.agent.semconv, Session is rankwatch.agent.session.Session)
print(rankwatch.agent.session.__spec__.name)
"""


def test_a_scripts_own_agent_package_is_its_own_under_rankwatch_run(collector, tmp_path):
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "__init__.py").write_text('WHOSE = "the user\'s"\n')
    (tmp_path / "train.py").write_text(SCRIPT)
    job = rankwatch_cli(
        *("run", "--collector", collector.url, "--run", "own-agent", "--", sys.executable, "train.py"),
        env={"RANKWATCH_TOKEN": collector.token},
        cwd=tmp_path,
    )
    collector.stop()
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.strip().splitlines()[-1] == "the user's"
    assert query(collector.db, "SELECT count(*) FROM steps WHERE run_id = 'own-agent'") == [(5,)]


def test_the_old_import_path_warns_and_is_the_agent_itself(tmp_path):
    done = subprocess.run([sys.executable, "-c", OLD_PATH], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    warned, same, spec = done.stdout.strip().splitlines()
    assert warned.startswith("warned: `import agent` is deprecated") and "from rankwatch import agent" in warned
    assert same == "True True True"
    assert spec == "rankwatch.agent.session"
