"""`serve --config FILE`: a trtllm-serve style YAML mapped onto the flags; unknown keys are exit 2."""

from __future__ import annotations

import pytest

from hetero_run.launch.cli import build_parser
from hetero_run.launch.serve import apply_config_file, build_configs
from hetero_run.topology.errors import ConfigError


def args_for(tmp_path, yaml_text: str, *flags: str):
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    drafter = tmp_path / "drafter"
    drafter.mkdir(exist_ok=True)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml_text.replace("DRAFTER", str(drafter)))
    return build_parser().parse_args(["serve", "--target", str(target), "--config", str(path), *flags]), drafter


def test_trtllm_speculative_config_maps_onto_the_flags(tmp_path):
    args, drafter = args_for(tmp_path, "speculative_config:\n  decoding_type: DraftTarget\n  max_draft_len: 6\n"
                             "  speculative_model: DRAFTER\nmax_seq_len: 2048\nport: 9001\nmax_queue: 3\n"
                             "max_batch_size: 5\nmax_num_tokens: 300\nkv_cache_config:\n  enable_block_reuse: false\n")
    config, server, engine = build_configs(args)
    assert args.drafter == str(drafter) and args.port == 9001 and args.max_queue == 3
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.enable_prefix_caching) == (5, 300, False)
    assert config.context == 2048 and config.speculation.max_draft_len == 6 and config.speculation.draft_len == 4
    assert config.algorithm == "auto" and server.model == "target"


def test_eagle3_maps_to_an_eagle3_drafter(tmp_path):
    args, drafter = args_for(tmp_path, "speculative_config:\n  decoding_type: Eagle3\n  max_draft_len: 3\n"
                             "  speculative_model_dir: DRAFTER\n")
    apply_config_file(args)
    assert args.drafter == f"eagle3:{drafter}" and args.algorithm == "eagle3" and args.draft_len == 3


def test_command_line_flags_win_over_the_file(tmp_path):
    args, _ = args_for(tmp_path, "port: 9001\nhost: 0.0.0.0\n", "--port", "7000")
    apply_config_file(args)
    assert args.port == 7000 and args.host == "0.0.0.0"


@pytest.mark.parametrize("text, message", [
    ("max_batch_sise: 4\n", "serve.yaml: max_batch_sise: unknown key"),
    ("max_qeue: 4\n", "unknown key (did you mean 'max_queue'?)"),
    ("speculative_config:\n  decoding_type: MTP\n", "speculative_config.decoding_type: 'MTP' is not supported"),
    ("speculative_config:\n  max_draft_len: 0\n  speculative_model: x\n", "must be an integer >= 1, got 0"),
    ("speculative_config:\n  decoding_type: DraftTarget\n", "draft_target needs speculative_model"),
    ("speculative_config:\n  extra: 1\n", "speculative_config.extra: unknown key"),
    ("port: eighty\n", "serve.yaml: port: not a valid value: 'eighty'"),
    ("log_requests: 3\n", "log_requests: expected true or false"),
    ("embedding_split: odd\n", "embedding_split: expected one of balanced, even"),
    ("- a\n- b\n", "expected a mapping"),
    ("port: [1\n", "not valid YAML"),
])
def test_bad_files_name_the_key(tmp_path, text, message):
    args, _ = args_for(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        apply_config_file(args)
    assert message in str(info.value)


def test_an_unknown_key_is_exit_2_naming_it(run_cli, tmp_path):
    args, _ = args_for(tmp_path, "speculative_config:\n  decoding_type: DraftTarget\n  speculative_model: DRAFTER\n"
                       "cuda_graph_config: {}\n")
    out = run_cli("serve", "--target", args.target, "--config", args.config)
    assert out.returncode == 2 and "cuda_graph_config: unknown key" in out.stderr and "Traceback" not in out.output
