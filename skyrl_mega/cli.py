"""`skyrl-mega` command line: make-tiny, train, demo, validate, convert, serve, data.

In: a subcommand, a recipe YAML and `key=value` overrides. Out: the config is validated in
this process (before any rank or process group starts), then torchrun launches the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "recipes", "qwen3_moe", "tiny_cpu.yaml")


def _load(recipe: str | None, overrides: list[str]):
    from skyrl_mega.config import load_config

    return load_config(recipe, overrides)


def _validate(cfg, nproc: int | None) -> int:
    """The one validator, in this process, before any rank or engine starts; returns the world size."""
    from skyrl_mega.config import validate_config

    world = nproc or cfg.parallel.world_size or 1
    validate_config(cfg, world, for_training=True, probe_engines=True)
    return world


def _print_cfg(cfg, args) -> None:
    from omegaconf import OmegaConf

    print(OmegaConf.to_yaml(cfg, resolve=args.resolve), end="", flush=True)


def cmd_make_tiny(args) -> int:
    from skyrl_mega.models.tiny import make_tiny

    try:
        make_tiny(args.family, args.out_dir, seed=args.seed, size=args.size, dtype=args.dtype, device=args.device,
                  weights=not args.config_only, multimodal=args.multimodal, mtp=args.mtp,
                  expert_layout=args.expert_layout)
    except ValueError as e:  # unknown family or size, --multimodal on another family: one line
        print(f"skyrl-mega make-tiny: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.size} {args.family} checkpoint to {args.out_dir}")
    return 0


def _print_checkpoint(path: str) -> None:
    """What `validate` found in the checkpoint: its expert layout (fused 3-D or per expert)."""
    from skyrl_mega.checkpoint.preflight import safetensors_files

    if not path or not os.path.isdir(path) or not safetensors_files(path):
        return  # config only: no weights to describe
    from skyrl_mega.checkpoint.hf_reader import expert_layout

    layout = expert_layout(path)
    fused = f" ({len(layout.members)} fused tensors)" if layout.members else ""
    print(f"checkpoint {path}: routed experts {layout.name}{fused}")


def cmd_validate(args) -> int:
    """Validates the recipe + overrides and prints the run's memory per GPU (config/memory.py);
    with -m, every job of the sweep (exit 2 if any fails)."""
    from skyrl_mega.config import ConfigError
    from skyrl_mega.config.memory import memory_table
    from skyrl_mega.config.sweep import sweep_jobs

    if not args.multirun:
        cfg = _load(args.recipe, args.overrides)
        if args.cfg:
            _print_cfg(cfg, args)
            return 0
        world = _validate(cfg, args.nproc)
        print(f"config OK for world size {world}")
        _print_checkpoint(cfg.model.path)
        for line in memory_table(cfg, world):
            print(line)
        return 0
    jobs, failed = sweep_jobs(args.overrides), 0
    for i, overrides in enumerate(jobs):
        label = f"[{i + 1}/{len(jobs)}] {' '.join(overrides)}"
        try:
            cfg = _load(args.recipe, overrides)
            if args.cfg:
                print(f"# {label}")
                _print_cfg(cfg, args)
                continue
            print(f"{label}: config OK for world size {_validate(cfg, args.nproc)}", flush=True)
        except ConfigError as e:
            failed += 1
            print(f"{label}: {e}", file=sys.stderr, flush=True)
    if failed:
        print(f"skyrl-mega: {failed} of {len(jobs)} configs are invalid", file=sys.stderr)
    return 2 if failed else 0


def cmd_train(args) -> int:
    """One training job: validate here, then torchrun the ranks (a sweep would run jobs one after
    another, each owning every device and engine: sweep with `validate -m`, launch each)."""
    from skyrl_mega.config.loader import resolve_recipe

    recipe = resolve_recipe(args.recipe) if args.recipe else None
    return _train(args, recipe, _load(recipe, args.overrides))


def cmd_demo(args) -> int:
    """`train` with the tiny_cpu recipe, after making the tiny random-weight model at model.path
    when nothing is there (its family: the recipe's config group, e.g. qwen3_moe)."""
    from skyrl_mega.config import ConfigError
    from skyrl_mega.config.loader import recipe_group, resolve_recipe
    from skyrl_mega.models.tiny import FAMILIES, make_tiny

    recipe = resolve_recipe(args.recipe)
    cfg = _load(recipe, args.overrides)
    if not args.cfg and cfg.model.path and not os.path.exists(cfg.model.path):
        family = recipe_group(recipe)[1]
        if family not in FAMILIES:
            raise ConfigError(f"demo: recipe {recipe} is in config group {family!r}, which has no tiny model "
                              f"(families: {sorted(FAMILIES)}); set model.path to a checkpoint")
        print(f"making tiny {family} model at {cfg.model.path}", flush=True)
        make_tiny(family, cfg.model.path)
    return _train(args, recipe, cfg)


def _train(args, recipe: str | None, cfg) -> int:
    from skyrl_mega.checkpoint.preflight import check_resume
    from skyrl_mega.launcher import run_torchrun

    if args.cfg:
        _print_cfg(cfg, args)
        return 0
    world = _validate(cfg, args.nproc)
    check_resume(cfg)  # checkpoint.resume=<path>: there and complete, before any rank starts
    os.makedirs(cfg.output_dir, exist_ok=True)
    argv = ([recipe] if recipe else []) + list(args.overrides)
    run_torchrun(args.entry, world, argv, timeout=args.timeout, env={"PYTHONUNBUFFERED": "1"},
                 stream=True)
    return 0


def cmd_convert(args) -> int:
    """Checks the inputs here (files, model family, layout), then torchruns the conversion;
    whatever a failed or killed conversion left at `<dst>.partial` is removed."""
    from skyrl_mega.checkpoint.convert import remove_partial
    from skyrl_mega.checkpoint.preflight import check_convert
    from skyrl_mega.launcher import run_torchrun

    hf_dir = args.src if args.direction == "hf-to-mcore" else args.hf
    if not hf_dir:
        raise SystemExit("skyrl-mega convert mcore-to-hf needs --hf <HF dir of the same architecture>")
    check_convert(args.direction, args.src, hf_dir, args.overrides, args.nproc)
    argv = [args.direction, args.src, args.dst, *args.overrides, "--shard-size", args.shard_size] + (
        ["--hf", args.hf] if args.hf else [])
    try:
        run_torchrun("skyrl_mega.checkpoint.convert", args.nproc, argv, timeout=args.timeout, stream=True)
    finally:
        remove_partial(args.dst)
    return 0


def cmd_serve(args) -> int:
    """One vLLM engine started as the recipe's trainer would start its own (for job scripts that
    put engines on other nodes): the same flags (weight-transfer backend, routed experts, the
    recipe's engine settings, the job secret's middleware beyond loopback); vLLM runs supervised
    (rollout/supervise.py: when it ends, its EngineCore and workers go too). --dry-run prints the command line (as JSON) instead."""
    import dataclasses
    import json

    from skyrl_mega.controller.engines import server_config
    from skyrl_mega.controller.placement import plan_placement
    from skyrl_mega.rollout import engine_caps

    cfg = _load(args.recipe, args.overrides)
    plan = plan_placement(args.placement, cfg.rollout)
    if plan.transport == "shm" and cfg.rollout.weight_transport == "auto":
        # a served engine is for trainers on other hosts, which send weights by the transport that
        # crosses hosts (placement.py): the engine runs its weight-transfer backend
        plan = dataclasses.replace(plan, transport="nccl")
    server = server_config(cfg, plan, host=args.host)
    argv = server.argv(args.port, engine_caps.installed().server_flags())
    if args.dry_run:
        print(json.dumps(argv))
        return 0
    from skyrl_mega.rollout.supervise import run_supervised

    sys.stdout.flush()
    return run_supervised(argv, server.env(None, args.gpus), name=f"vLLM server on port {args.port}")


def cmd_data(args) -> int:
    """Reads prompt datasets (jsonl, parquet, datasets' save_to_disk directories), prints what it
    found and writes the kept rows in the standard layout (data/prepare.py); a malformed row or
    an unreadable input is one line naming it and exit code 2."""
    from skyrl_mega.data.dataset import DatasetError
    from skyrl_mega.data.prepare import prepare

    try:
        tokenizer = _tokenizer(args.tokenizer) if args.tokenizer else None
        report = prepare(args.sources, args.out, tokenizer, args.max_prompt_len,
                         chat_template=not args.no_chat_template, keep_duplicates=args.keep_duplicates)
    except DatasetError as e:
        from skyrl_mega.errors import one_line

        print(f"skyrl-mega data: {one_line(e)}", file=sys.stderr)
        return 2
    for line in report.lines():
        print(line)
    print(f"wrote {report.kept} rows to {args.out}")
    return 0


def _tokenizer(path: str):
    from skyrl_mega.data.dataset import DatasetError

    if not os.path.isdir(path):
        raise DatasetError(f"--tokenizer {path!r} is not a directory (an HF model or tokenizer directory)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise DatasetError(f"--tokenizer {path!r}: cannot load a tokenizer there ({e})") from None


def main(argv: list[str] | None = None) -> int:
    from skyrl_mega.errors import EXIT_USER_ERROR, UserError, one_line
    from skyrl_mega.launcher import LaunchError

    parser = argparse.ArgumentParser(prog="skyrl-mega", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("make-tiny", help="write a tiny random-weight HF checkpoint")
    p.add_argument("family", help="qwen3_moe | qwen3_5_moe | nemotron3")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", default="tiny", help="tiny | 1b | 2b | 8b | 15b (qwen3_moe; see models/tiny.py SIZES)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", help="where to initialise (cuda for the large sizes)")
    p.add_argument("--config-only", action="store_true",
                   help="config and tokenizer, no weights (for vLLM's --load-format dummy and random-init trainers)")
    p.add_argument("--multimodal", action="store_true",
                   help="qwen3_5_moe: Qwen3.5's released multimodal layout (text model + a tiny vision tower)")
    p.add_argument("--expert-layout", choices=["fused", "per-expert"], default=None,
                   help="routed experts as fused 3-D tensors or one tensor per expert (default: the family's "
                        "released layout: fused for qwen3_5_moe, per-expert for the others)")
    p.add_argument("--mtp", action="store_true",
                   help="qwen3_5_moe, nemotron3: one multi-token-prediction layer's tensors (mtp.*), as released")
    p.set_defaults(fn=cmd_make_tiny)

    p = sub.add_parser("convert", help="HF <-> Megatron dist-ckpt at any parallel layout")
    p.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf"])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--hf", help="mcore-to-hf: the HF dir of the same architecture (config, tokenizer)")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--shard-size", default="1GiB",
                   help="most bytes of one output file (HF shard / a rank's dist-ckpt file); about a rank's peak memory")
    p.add_argument("overrides", nargs="*", help="e.g. parallel.ep=2 model.dtype=bfloat16")
    p.set_defaults(fn=cmd_convert)

    p = sub.add_parser("serve", help="one vLLM engine with the flags the recipe's trainer gives its own")
    p.add_argument("--recipe", required=True)
    p.add_argument("--host", default="127.0.0.1", help="bind address (beyond loopback: the job secret guards control)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--placement", default="disaggregated", choices=["colocated", "disaggregated"])
    p.add_argument("--gpus", default=None, help="CUDA_VISIBLE_DEVICES for this engine")
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command line and exit")
    p.add_argument("overrides", nargs="*", help="Hydra overrides: key=value")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("data", help="read prompt datasets (jsonl, parquet, datasets save_to_disk dirs), report "
                                     "counts, write the standard layout")
    p.add_argument("sources", nargs="+", help=".jsonl / .parquet files, directories written by save_to_disk")
    p.add_argument("--out", required=True, help="OUT.jsonl or OUT.parquet: {prompt, ground_truth, data_source, "
                                                "extra_info} per kept row")
    p.add_argument("--tokenizer", "--model", dest="tokenizer",
                   help="HF model or tokenizer directory: count prompt tokens (needed by --max-prompt-len)")
    p.add_argument("--max-prompt-len", type=int, default=None, help="leave out prompts longer than this (tokens)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="count string prompts' tokens without the chat template (as data.chat_template=false)")
    p.add_argument("--keep-duplicates", action="store_true", help="keep rows whose prompt an earlier row has")
    p.set_defaults(fn=cmd_data)

    for name, fn, helptext in (("train", cmd_train, "launch training ranks with torchrun"),
                               ("demo", cmd_demo, "the tiny CPU demo (tiny_cpu recipe; makes its tiny model)"),
                               ("validate", cmd_validate, "check a recipe + overrides and exit")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--recipe", default=DEFAULT_RECIPE if name == "demo" else None)
        p.add_argument("--nproc", type=int, default=None, help="ranks (default: parallel.world_size)")
        p.add_argument("--timeout", type=float, default=3600)
        p.add_argument("--entry", default="skyrl_mega.trainer", help=argparse.SUPPRESS)
        p.add_argument("-c", "--cfg", choices=["job"], help="print the composed config and exit (as Hydra's)")
        p.add_argument("--resolve", action="store_true", help="with --cfg: resolve ${...} interpolations")
        if name == "validate":
            p.add_argument("-m", "--multirun", action="store_true",
                           help="sweep: validate every combination of comma lists (parallel.ep=1,2)")
        p.add_argument("overrides", nargs="*", help="Hydra overrides: key=value, +key=value, ~key")
        p.set_defaults(fn=fn)

    args, extra = parser.parse_known_args(argv)
    bad = [a for a in extra if ("=" not in a and not a.startswith("~")) or a.startswith("-")]
    if bad or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(bad or extra)}")
    if extra:  # key=value overrides given after an option
        args.overrides = list(args.overrides) + extra
    try:
        return args.fn(args)
    except UserError as e:  # config, checkpoint, a rank's user error: one line, no traceback
        print(f"skyrl-mega: {one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except LaunchError as e:  # the failed rank printed its traceback above
        print(f"skyrl-mega: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
