"""``import sinkprof`` settles oneMKL's choice of vector math kernels before a multi-threaded call
(sinkprof/cpu_math.py): without it, a fresh process's first sizable ``exp`` or ``log`` could run a
low-accuracy kernel on one thread's chunk and differ from the next identical call. Without the
settling, about one first call in seven differed here (2-4 threads, 32768 elements), so twelve
processes of four first calls each catch a regression almost surely."""
import os
import subprocess
import sys

SCRIPT = """
import sinkprof, torch
g = torch.Generator().manual_seed(0)
for dtype in (torch.float64, torch.float32):
    x = (torch.randn(2, 4, 64, 64, generator=g, dtype=torch.float64).abs() * 3 + 0.1).to(dtype)   # 32768 elements
    for fn in (torch.exp, torch.log):
        first, again = fn(x), fn(x)
        print("same" if torch.equal(first, again) else "DIFF")
"""


def test_the_first_exp_and_log_of_a_process_match_the_next_ones():
    env = dict(os.environ, OMP_NUM_THREADS="2")   # two intra-op threads race for the first call
    lines = []
    for _ in range(12):   # one after another: processes sharing the cores would not race
        res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stderr
        lines += res.stdout.split()
    assert lines.count("same") == 12 * 4 and "DIFF" not in lines, lines
