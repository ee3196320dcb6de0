import json


def test_help_lists_subcommands(run_cli):
    out = run_cli("--help")
    assert out.returncode == 0
    assert "doctor" in out.stdout


def test_doctor_single_rank_without_launcher(run_cli):
    out = run_cli("doctor", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["world_size"] == 1
    assert report["backend"] == "none"
    assert report["link"] is None
    (rank,) = report["ranks"]
    assert rank["rank"] == 0 and rank["mem_total_bytes"] > 0 and rank["torch"]


def test_bad_value_is_one_line_exit_2(run_cli):
    out = run_cli("doctor", "--iters", "0")
    assert out.returncode == 2
    assert "--iters" in out.stderr and "must be >= 1" in out.stderr
    assert "Traceback" not in out.output


def test_bad_peer_timeout_names_the_field(run_cli):
    out = run_cli("doctor", "--peer-timeout", "-1")
    assert out.returncode == 2
    assert "peer_timeout" in out.stderr and "Traceback" not in out.output
