"""`graphtap harvest`: a prompt set's activations at chosen sites and positions, written
as sharded safetensors with a manifest, for probe datasets and sparse-autoencoder
training. Each shard holds a fixed run of prompts and is written under a temporary name
and renamed, and the manifest (model, sites, dtype, positions, the prompts' hash, each
shard's rows and sha256) is rewritten after each one, so an interrupted harvest resumes
where it stopped, and the same inputs give the same files.

A shard's tensors: one per site (`blocks.L.hook_resid_post`: [rows, width]) and, per
row, `prompt_index` (into the dataset), `position` and `token_id` (the token at that
position). Rows are in (prompt, position) order; every site has the same rows.

Transport: with the engine's bulk sink (hook_config.sink_dir; `graphtap harvest` sets
one up) the rows leave the worker by the sink's writer thread, outside the per-request
output merge (harvest_sink.py); without one, through each finished request's outputs.
The files are the same bytes either way."""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class HarvestPlan:
    """What makes a harvest reproducible; a resumed one must match it exactly."""

    model: str
    sites: tuple[str, ...]
    positions: object  # a capture position rule ("all", "prompt", ...)
    dtype: str  # "float32" or "model"
    shard_prompts: int
    max_tokens: int
    prompts: int
    prompts_sha256: str


COLUMNS = ("prompt", "text", "prompt_token_ids")  # where a prompt is found, in this order


def read_dataset(source: str | Path, column: str | None = None) -> list[str | list[int]]:
    """The prompts of a JSONL file (one object per line with "prompt" or "text", a
    string, or "prompt_token_ids", a list of ints; blank lines are skipped) or of a
    Hugging Face dataset: a folder written by `Dataset.save_to_disk`, or a hub name
    with an optional split (`NAME` or `NAME:SPLIT`, default train), read with the
    `datasets` package. `column`: the dataset's column of prompts (default the first
    of COLUMNS it has)."""
    if Path(source).is_file():
        return _read_jsonl(Path(source), column)
    return _read_hf(str(source), column)


def _read_jsonl(path: Path, column: str | None) -> list[str | list[int]]:
    out: list[str | list[int]] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        found = [row[c] for c in ((column,) if column else COLUMNS)
                 if isinstance(row, dict) and c in row]
        out.append(_prompt(found[0] if found else None, f"{path}:{n}", column))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def _read_hf(source: str, column: str | None) -> list[str | list[int]]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{source}: not a file; reading a Hugging Face dataset needs the "
                         f"datasets package (pip install 'graphtap[harvest]')") from None
    name, _, split = source.partition(":")
    try:
        ds = datasets.load_from_disk(name) if Path(name).is_dir() else \
            datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds: say which source
        raise ValueError(f"{source}: not a JSONL file or a dataset datasets can read "
                         f"({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):  # a saved DatasetDict: choose its split
        if (split or "train") not in ds:
            raise ValueError(f"{source}: no split {split or 'train'!r} (it has "
                             f"{', '.join(ds)}); name one as {name}:SPLIT")
        ds = ds[split or "train"]
    names = [column] if column else [c for c in COLUMNS if c in ds.column_names]
    if not names or names[0] not in ds.column_names:
        raise ValueError(f"{source}: no column {column or ' or '.join(COLUMNS)} (it has "
                         f"{', '.join(ds.column_names)}); choose one with --column")
    out = [_prompt(v, f"{source}[{i}]", column) for i, v in enumerate(ds[names[0]])]
    if not out:
        raise ValueError(f"{source}: no prompts")
    return out


def _prompt(value, where: str, column: str | None) -> str | list[int]:
    """A non-empty string or a non-empty list of ints, else a ValueError naming where."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(i, int) for i in value):
        return value
    wanted = f"\"{column}\"" if column else "\"prompt\", \"text\" or \"prompt_token_ids\""
    raise ValueError(f"{where}: expected a non-empty {wanted} (a string, or a list of "
                     f"token ids)")


def prompts_sha256(prompts: list) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


def harvest(llm, prompts: list, sites: list[str], out_dir: str | Path, positions="all",
            dtype: str = "float32", shard_prompts: int = 64, max_tokens: int = 1,
            stop_after: int | None = None, progress: bool = True,
            sink: bool | None = None) -> dict:
    """Harvest into out_dir (see the module docstring); returns the manifest. Shards
    the manifest already lists, with files whose sha256 matches, are skipped.
    `stop_after`: write at most this many new shards (an interrupted run, in tests).
    `sink`: through the engine's bulk sink (None: if the engine has one)."""
    from graphtap.harvest_sink import sink_index

    if shard_prompts < 1 or max_tokens < 1:
        raise ValueError("harvest: shard_prompts and max_tokens must be at least 1")
    index = sink_index(llm) if sink is not False else None
    if sink and index is None:
        raise ValueError("harvest: sink=True needs an engine with hook_config.sink_dir")
    seen = None if index is None else {s["file"] for s in index["shards"]}  # read before
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = HarvestPlan(str(llm.llm_engine.model_config.model), tuple(sites), positions, dtype,
                       shard_prompts, max_tokens, len(prompts), prompts_sha256(prompts))
    manifest = _resume(out, plan)
    done = {s["index"] for s in manifest["shards"]}
    starts = range(0, len(prompts), shard_prompts)
    bar = _bar(len(prompts), progress, sum(s["prompts"][1] - s["prompts"][0]
                                           for s in manifest["shards"]))
    written, t0, rows_total, bytes_total, tokens_total = 0, time.perf_counter(), 0, 0, 0
    try:
        for index, start in enumerate(starts):
            if index in done:
                continue
            if stop_after is not None and written >= stop_after:
                break
            end = min(start + shard_prompts, len(prompts))
            tensors, tokens, seen = _shard(llm, prompts[start:end], start, plan, seen)
            entry = _write(out, index, (start, end), tensors)
            manifest["shards"].append(entry)
            manifest["shards"].sort(key=lambda s: s["index"])
            manifest["rows"] = sum(s["rows"] for s in manifest["shards"])
            _save_manifest(out, manifest)
            written += 1
            rows_total += entry["rows"]
            bytes_total += entry["bytes"]
            tokens_total += tokens
            if bar is not None:
                spent = max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix(tokens_s=f"{tokens_total / spent:.0f}",
                                rows_s=f"{rows_total / spent:.0f}",
                                GB=f"{bytes_total / 1e9:.3f}")
                bar.update(end - start)
    finally:
        if bar is not None:
            bar.close()
    manifest["complete"] = len(manifest["shards"]) == len(starts)
    _save_manifest(out, manifest)
    return manifest


def _shard(llm, prompts: list, first: int, plan: HarvestPlan,
           seen: set | None) -> tuple[dict, int, set | None]:
    """One shard's tensors, its tokens, and the sink shards read so far (None: no sink)."""
    from vllm import SamplingParams

    from graphtap.harvest_sink import rows_from_sink

    spec = {"capture": [{"site": s, "positions": plan.positions, "dtype": plan.dtype,
                         "sink": seen is not None} for s in plan.sites]}
    params = SamplingParams(max_tokens=plan.max_tokens, temperature=0.0, ignore_eos=True,
                            hooks=spec)
    inputs = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(inputs, params, use_tqdm=False)
    for i, o in enumerate(outs):
        if o.hooks is not None and o.hooks.error:
            raise RuntimeError(f"harvest: prompt {first + i}: {o.hooks.error}")
    if seen is not None:
        rows, where, seen = rows_from_sink(llm, outs, plan.sites, seen, first)
    else:
        rows, where = _rows_from_outputs(outs, plan.sites, first)
    per_site: dict[str, list[torch.Tensor]] = {s: [r[s] for r in rows] for s in plan.sites}
    index, position, token = [], [], []
    tokens = 0
    for i, (o, pos) in enumerate(zip(outs, where)):
        ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        tokens += len(ids)
        index.append(np.full(len(pos), first + i, np.int64))
        position.append(pos.astype(np.int64))
        token.append(np.asarray(ids, np.int64)[pos])
    tensors = {s: torch.cat(rows).contiguous() for s, rows in per_site.items()}
    tensors["prompt_index"] = torch.from_numpy(np.concatenate(index))
    tensors["position"] = torch.from_numpy(np.concatenate(position))
    tensors["token_id"] = torch.from_numpy(np.concatenate(token))
    return tensors, tokens, seen


def _rows_from_outputs(outs: list, sites: tuple[str, ...], first: int):
    """Per output {site: rows} and the positions, from the requests' own captures."""
    rows, where = [], []
    for i, o in enumerate(outs):
        hooks = o.hooks
        if hooks is None:
            raise RuntimeError(f"harvest: prompt {first + i}: no captures came back")
        pos = hooks.positions[sites[0]]
        for s in sites:
            if not torch.equal(hooks.positions[s], pos):
                raise RuntimeError(f"harvest: prompt {first + i}: {s} came back at other "
                                   f"positions than {sites[0]}")
        rows.append({s: hooks[s] for s in sites})
        where.append(pos.numpy())
    return rows, where


def _write(out: Path, index: int, prompts: tuple[int, int], tensors: dict) -> dict:
    from safetensors.torch import save_file

    name = f"shard-{index:05d}.safetensors"
    tmp = out / f".{name}.tmp"
    # one metadata key: safetensors writes several in a varying order (a hash map's),
    # and the same rows must make the same bytes (the manifest's sha256, resume)
    save_file(tensors, str(tmp), metadata={"graphtap_shard": json.dumps(
        {"index": index, "prompts": list(prompts)})})
    os.replace(tmp, out / name)
    return {"index": index, "file": name, "prompts": list(prompts),
            "rows": int(tensors["position"].shape[0]), "bytes": (out / name).stat().st_size,
            "sha256": _sha256(out / name)}


def _resume(out: Path, plan: HarvestPlan) -> dict:
    path = out / MANIFEST
    fresh = {"graphtap_harvest": 1, "plan": asdict(plan), "shards": [], "rows": 0,
             "complete": False}
    if not path.exists():
        return fresh
    old = json.loads(path.read_text())
    if old.get("plan") != json.loads(json.dumps(asdict(plan))):
        raise ValueError(f"harvest: {out} holds a different harvest (its manifest's plan "
                         f"differs: model, sites, positions, dtype, shard size or prompts); "
                         f"use another --out")
    kept = [s for s in old["shards"]
            if (out / s["file"]).is_file() and _sha256(out / s["file"]) == s["sha256"]]
    return {**fresh, "shards": kept, "rows": sum(s["rows"] for s in kept)}


def _save_manifest(out: Path, manifest: dict) -> None:
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _bar(total: int, on: bool, done: int):
    if not on:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, unit="prompt", desc="harvest")
