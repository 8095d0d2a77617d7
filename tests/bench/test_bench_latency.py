"""`jaxpaged bench latency`: the decode step's wall time and the host's share, phase by phase."""

import re

from jaxpaged.benchmarks import latency


def test_latency_prints_both_batch_sizes_with_the_host_phases_and_their_ratio(capsys, tmp_path):
    assert latency.main(["--seqs", "4,8", "--new-tokens", "10", "--repeat", "1", "--max-num-seqs", "8", "--json",
                         str(tmp_path / "runs.json")]) == 0
    out = capsys.readouterr().out
    for n in (4, 8):
        line = next(line for line in out.splitlines() if line.strip().startswith(f"{n} seqs"))
        assert re.search(r"step \d+\.\d+ ms .*host \d+\.\d+ ms", line), line
    phases = out.split("phases ms:")[1].splitlines()[0]
    for phase in ("schedule", "dispatch", "inputs", "forward", "fetch", "update", "outputs", "device_wait"):
        assert f"{phase} " in phases, phases
    assert re.search(r"at 8 / at 4: step \d+\.\d+x, host \d+\.\d+x", out), out
    runs = (tmp_path / "runs.json").read_text()
    assert '"host_ms"' in runs and '"steps"' in runs
