"""``kvgym generate``: run one prompt through the paged cache under one controller and show what the cache holds
afterwards (tiers, bytes read and moved, decisions), with every flag checked before the model is loaded."""

from __future__ import annotations

from pathlib import Path

from kvgym.arguments import bundled_prompt
from kvgym.reports import write_json


def _prompt_ids(loaded, text: str, chat: bool) -> list[int]:
    from eval.tasks.prompt import text_prompt

    return text_prompt(loaded.tokenizer, text, chat).ids


def read_prompt_file(path: Path) -> str:
    """The UTF-8 text of ``--prompt-file``; a ``ValueError`` naming the file when it is a folder, missing,
    unreadable or binary."""
    accepted = "expected a UTF-8 text file"
    if path.is_dir():
        raise ValueError(f"--prompt-file {path}: is a folder; {accepted}")
    if not path.is_file():
        raise ValueError(f"--prompt-file {path}: no such file; {accepted}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"--prompt-file {path}: cannot be read ({err.strerror}); {accepted}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompt-file {path}: not UTF-8 text (byte {err.start} is 0x{data[err.start]:02x}); "
                         f"{accepted}") from None
    if "\x00" in text:
        raise ValueError(f"--prompt-file {path}: holds NUL bytes, so it looks binary; {accepted}")
    return text


def check_generate_args(args) -> str:
    """Everything ``generate`` can check before loading the model; returns the prompt text."""
    for flag, value, least in (("--max-new-tokens", args.max_new_tokens, 1), ("--block-size", args.block_size, 1),
                               ("--prefill-chunk", args.prefill_chunk, 1), ("--decide-every", args.decide_every, 1),
                               ("--host-blocks", args.host_blocks, 0), ("--disk-blocks", args.disk_blocks, 0)):
        if value < least:
            raise ValueError(f"{flag} {value}: must be {'a positive integer' if least else 'an integer >= 0'}")
    if args.prompt is not None:
        text, source = args.prompt, "--prompt"
    elif args.prompt_file is not None:
        text, source = read_prompt_file(args.prompt_file), f"--prompt-file {args.prompt_file}"
    else:
        text, source = bundled_prompt(), "the bundled prompt"
    if not text.strip():
        raise ValueError(f"{source}: the prompt is empty; give some text to continue or answer")
    return text


def generate(args) -> None:
    """``kvgym generate``: one prompt under one controller; prints the text and the cache's state after the run
    (``args``: the command's flags)."""
    from rich.console import Console
    from rich.table import Table

    from agents.registry import make_controller
    from cache.models import load_model
    from cache.paged_cache import CacheConfig
    from cache.runner import Runner

    text = check_generate_args(args)
    controller = make_controller(args.controller) if args.controller else None
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    ids = _prompt_ids(loaded, text, chat=not args.no_chat)
    cache_config = CacheConfig(block_size=args.block_size, host_blocks=args.host_blocks, disk_blocks=args.disk_blocks)
    runner = Runner(loaded.model, loaded.tokenizer, cache_config, controller=controller, budget=args.budget,
                    prefill_chunk=args.prefill_chunk, decide_every=args.decide_every, protocol=args.protocol)
    result = runner.run(ids, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                        temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if result.cache is not None:
        result.cache.close()
    console = Console()
    console.print(f"[bold]model[/] {loaded.name}  [bold]controller[/] {args.controller or 'built-in oldest-first'}  "
                  f"[bold]prompt[/] {result.prompt_tokens} tokens  "
                  f"[bold]budget[/] {args.budget if args.budget is not None else 'full'}"
                  + (f" = {result.budget_blocks[0]} blocks/layer" if result.budget_blocks else ""))
    console.print("[bold]output:[/]")
    print(result.text)
    table = Table(title="cache state after the run (all layers)")
    for column in ("tier", "blocks (sum)", "per layer min..max"):
        table.add_column(column)
    for tier, counts in result.blocks_per_tier.items():
        table.add_row(tier, str(sum(counts)), f"{min(counts)}..{max(counts)}")
    console.print(table)
    summary = result.summary()
    console.print(f"bytes read by attention per decoded token: {summary['bytes_read_per_token']:,}  "
                  f"(all layers)  bytes moved: {summary['bytes_moved'] or 0}")
    console.print(f"prefill {summary['prefill_s']} s, decode {summary['decode_ms_per_token']} ms/token, "
                  f"decisions {summary['decisions']}, operations {summary['operations']}, fallbacks {summary['fallbacks']}")
    if args.json:
        write_json({**summary, "text": result.text}, args.json)
