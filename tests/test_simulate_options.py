"""``bench --simulate`` replays the p2p ring: a comm other than p2p, from --comm or from a profile,
is refused once, before any file is made or any case runs, naming where it came from; --comm is
parsed as it is everywhere else."""
import pytest

QUICK = ("--iters", "1", "--warmup", "0", "--softmax", "vanilla", "--mask", "causal", "--dtype", "fp64")


@pytest.mark.parametrize("profile,says", [
    ('comm = ["a2a"]\n', 'comm = ["a2a"]'),
    ('comm = ["p2p", "a2a"]\n', 'comm = ["p2p", "a2a"]'),             # its p2p cases ran and wrote rows first
    ('comm = ["a2a+p2p"]\n', 'comm = ["a2a+p2p"]'),                   # it said "--a2a-size 2 must divide --ranks 1"
    ('comm = "a2a"\n[[cases]]\ncomm = ["p2p"]\n[[cases]]\nsoftmax = ["vanilla"]\n', 'comm = ["a2a"]'),
    ('[[cases]]\ncomm = ["p2p"]\n[[cases]]\ncomm = ["a2a"]\n', '[[cases]] #2: comm = ["a2a"]'),
], ids=["a2a", "p2p-and-a2a", "a2a+p2p", "top-level-under-cases", "one-of-the-cases"])
def test_a_profile_comm_other_than_p2p_is_refused_before_the_csv_is_made(cli, tmp_path, profile, says):
    path = tmp_path / "a2a.toml"
    path.write_text(profile + "seq_len = 64\n")
    out = tmp_path / "simout" / "x.csv"
    res = cli("bench", "--simulate", "4", "--profile", str(path), "--csv", str(out), *QUICK, timeout=120)
    said = " ".join(res.stderr.split())
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"profile {path}" in said and says in said, said
    assert "with --simulate: a simulation replays the p2p ring; add --comm p2p" in said, said
    assert "--ranks" not in said and "Traceback" not in said, said
    assert res.stdout == ""
    assert not (tmp_path / "simout").exists()


def test_a_command_line_comm_overrides_the_profile_for_simulate(cli, tmp_path):
    path = tmp_path / "a2a.toml"
    path.write_text('comm = ["a2a"]\nseq_len = 64\n')
    out = tmp_path / "x.csv"
    res = cli("bench", "--simulate", "2", "--profile", str(path), "--comm", "p2p", "--csv", str(out), *QUICK,
              timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert out.exists() and not (tmp_path / "x.csv.partial").exists()


def test_comm_with_simulate_is_parsed_as_without_it(cli, tmp_path):
    """``--comm p2p,`` ran without --simulate and was refused with it; ``--comm ''`` was refused
    with --simulate as if the empty value were a comm other than p2p."""
    res = cli("bench", "--simulate", "2", "--comm", "p2p,", *QUICK, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    for comm in ("", " , "):
        res = cli("bench", "--simulate", "2", "--comm", comm, *QUICK, timeout=120)
        said = " ".join(res.stderr.split())
        assert res.returncode == 2, res.stdout + res.stderr
        assert "--comm needs at least one value, e.g. p2p (or 'all')" in said and "with --simulate" not in said, said
    res = cli("bench", "--simulate", "2", "--comm", "p2p,a2a", "--csv", str(tmp_path / "x.csv"), *QUICK, timeout=120)
    said = " ".join(res.stderr.split())
    assert res.returncode == 2, res.stdout + res.stderr
    assert ("--comm p2p,a2a with --simulate: a simulation replays the p2p ring; use --comm p2p (or drop --simulate)"
            in said), said
    assert not list(tmp_path.iterdir())

