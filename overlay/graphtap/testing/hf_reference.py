"""HF transformers reference for steering: the same edits as graphtap, with module hooks.

HF decoder layers carry the residual stream whole, so the TransformerLens sites are:
  resid_pre[L]   the input of layer L               (forward pre-hook on the layer)
  resid_post[L]  the output of layer L              (forward hook on the layer)
  resid_mid[L]   resid_pre[L] + attention output    (edit the attention output so that
                                                     the sum takes the steered value)
  attn.hook_z[L] o_proj's input, per head           (forward pre-hook on o_proj)
Every steer is applied in list order with graphtap's formula, in float32:
  delta = a*v + (clamp(<h, v_hat>, lo, hi) - <h, v_hat>) * v_hat
Head edits at z are written plainly instead (scale a head's slice, add to it). A
conditional steer acts once its condition, scored at the last prompt token, is met.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from graphtap.spec import parse_spec, steer_bounds
from graphtap.spec.packed import values_of
from graphtap.spec.sites import parse_site


def _selected(rule, positions: torch.Tensor, prompt_len: int) -> torch.Tensor:
    if rule == "all":
        return torch.ones_like(positions, dtype=torch.bool)
    if rule == "prompt":
        return positions < prompt_len
    if rule == "generated":
        return positions >= prompt_len
    if rule == "last_prompt":
        return positions == prompt_len - 1
    if isinstance(rule, dict) or hasattr(rule, "start"):
        start, end = (rule["start"], rule["end"]) if isinstance(rule, dict) else (rule.start, rule.end)
        return (positions >= start) & (positions < end)
    return torch.isin(positions, torch.tensor(list(rule)))


def apply_steers(stream: torch.Tensor, steers: list, positions: torch.Tensor, prompt_len: int):
    """stream [T, H] -> steered stream; each steer: (Steer, a, lo, hi)."""
    s = stream.float()
    for steer, a, lo, hi in steers:
        mask = _selected(steer.positions, positions, prompt_len).unsqueeze(1)
        v = torch.from_numpy(values_of(steer.vector).copy())
        norm = float(v.norm())
        u = v / norm if norm > 0 else torch.zeros_like(v)
        p = s @ u
        lo_t = -math.inf if lo is None else lo
        d = a * v + (p.clamp(lo_t, hi) - p).unsqueeze(1) * u
        s = torch.where(mask, s + d, s)
    return s.to(stream.dtype)


def apply_head_steers(z: torch.Tensor, steers: list, positions: torch.Tensor,
                      prompt_len: int, head_dim: int) -> torch.Tensor:
    """z [T, heads * head_dim] -> edited: "scale" multiplies the chosen heads' slices,
    "add" adds scale * vector to each chosen head (or to the whole row)."""
    s = z.float().clone()
    for steer, _, _, _ in steers:
        mask = _selected(steer.positions, positions, prompt_len).unsqueeze(1)
        new = s.clone()
        heads = steer.heads or []
        if steer.op == "scale":
            for h in heads:
                new[:, h * head_dim:(h + 1) * head_dim] *= steer.scale
        elif heads:
            v = steer.scale * torch.from_numpy(values_of(steer.vector).copy())
            for h in heads:
                new[:, h * head_dim:(h + 1) * head_dim] += v
        else:
            new += steer.scale * torch.from_numpy(values_of(steer.vector).copy())
        s = torch.where(mask, new, s)
    return s.to(z.dtype)


class _PositionTracker:
    """Positions of the tokens in the current forward call (batch of one, KV cache on)."""

    def __init__(self):
        self.next = 0
        self.current = torch.arange(0)

    def pre_hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = ids.shape[1]
        self.current = torch.arange(self.next, self.next + n)
        self.next += n


def _score(c, row: torch.Tensor) -> bool:
    """A condition's verdict on one row of the stream (graphtap's formula, float32)."""
    w = torch.from_numpy(values_of(c.vector).copy())
    dot = row.float() @ w
    score = dot / w.norm() if c.score == "projection" else dot + c.bias
    if c.activation == "sigmoid":
        score = torch.sigmoid(score)
    return bool(score < c.threshold) if c.compare == "below" else bool(score > c.threshold)


class _Gates:
    """Conditional steers: each gate decided at its condition's site from the row of the
    last prompt token, as it leaves that site's own steering (what graphtap's op sees)."""

    def __init__(self, spec, num_layers: int, prompt_len: int):
        self.prompt_len = prompt_len
        self.open: dict[int, bool] = {}
        self.at: dict[tuple[int, str], list] = {}
        for i, s in enumerate(spec.steer):
            if s.condition is not None:
                site = parse_site(s.condition.site, num_layers)
                self.at.setdefault((site.layer, site.kind), []).append((i, s.condition))

    def active(self, steers: list) -> list:
        return [x[:4] for x in steers if x[0].condition is None or self.open.get(x[4])]

    def decide(self, key, stream: torch.Tensor, positions: torch.Tensor) -> None:
        for i, c in self.at.get(key, ()):
            hit = (positions == self.prompt_len - 1).nonzero()
            if len(hit):
                self.open[i] = _score(c, stream[int(hit[0])])


@contextmanager
def hf_steering(model, hooks: dict, prompt_len: int):
    """Install graphtap-equivalent steering on an HF causal LM for one generate call."""
    spec = parse_spec(hooks)
    layers = model.model.layers
    tracker = _PositionTracker()
    handles = [model.register_forward_pre_hook(tracker.pre_hook, with_kwargs=True)]
    gates = _Gates(spec, len(layers), prompt_len)
    by_site: dict[tuple[int, str], list] = {key: [] for key in gates.at}
    for i, s in enumerate(spec.steer):
        site = parse_site(s.site, len(layers))
        a, lo, hi = steer_bounds(s)
        by_site.setdefault((site.layer, site.kind), []).append((s, a, lo, hi, i))

    def edit(x, key):
        out = apply_steers(x, gates.active(by_site[key]), tracker.current, prompt_len)
        gates.decide(key, out, tracker.current)
        return out

    stash: dict[int, torch.Tensor] = {}
    for (layer, kind), steers in by_site.items():
        mod, key = layers[layer], (layer, kind)
        if kind == "attn_z":
            attn = mod.self_attn

            def o_in(module, args, steers=steers, d=attn.head_dim):
                z = apply_head_steers(args[0][0], gates.active(steers), tracker.current,
                                      prompt_len, d)
                return (z[None], *args[1:])
            handles.append(attn.o_proj.register_forward_pre_hook(o_in))
        elif kind == "resid_pre":
            def pre(module, args, kwargs, key=key):
                if args:
                    return (edit(args[0][0], key)[None], *args[1:]), kwargs
                kwargs["hidden_states"] = edit(kwargs["hidden_states"][0], key)[None]
                return args, kwargs
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        elif kind == "resid_post":
            def post(module, args, output, key=key):
                h = output[0] if isinstance(output, tuple) else output
                h = edit(h[0], key)[None]
                return (h, *output[1:]) if isinstance(output, tuple) else h
            handles.append(mod.register_forward_hook(post))
        else:  # resid_mid: remember the layer input, then edit the attention output
            def keep(module, args, kwargs, layer=layer):
                stash[layer] = args[0] if args else kwargs["hidden_states"]
            def attn(module, args, output, layer=layer, key=key):
                out = output[0] if isinstance(output, tuple) else output
                resid = stash[layer]
                new = edit(resid[0] + out[0], key)
                out = (new - resid[0].float()).to(out.dtype)[None]
                return (out, *output[1:]) if isinstance(output, tuple) else out
            handles.append(mod.register_forward_pre_hook(keep, with_kwargs=True))
            handles.append(mod.self_attn.register_forward_hook(attn))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, hooks: dict | None = None):
    """Greedy tokens and their logprobs from HF, optionally steered: the parity reference."""
    ids = torch.tensor([prompt_ids])
    ctx = hf_steering(model, hooks, len(prompt_ids)) if hooks else _null()
    with ctx, torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=model.config.pad_token_id)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(sc[0].float(), -1)[t].item() for sc, t in zip(out.logits, tokens)]
    return tokens, logprobs


@contextmanager
def _null():
    yield


def hf_capture(model, prompt_ids: list[int], max_new_tokens: int, sites: list[str],
               hooks: dict | None = None):
    """Greedy generate and record the residual stream at `sites` for every position that
    ran through the model (steering in `hooks` applied first, as graphtap does):
    returns ({site: rows float32 [P, H]}, {site: positions}), rows in position order."""
    steering = hf_steering(model, hooks, len(prompt_ids)) if hooks else _null()
    with steering:  # registered first, so the capture hooks below see steered values
        return _captured_generate(model, prompt_ids, max_new_tokens, sites)


def _captured_generate(model, prompt_ids, max_new_tokens, sites):
    layers = model.model.layers
    tracker = _PositionTracker()
    rows: dict[str, list[torch.Tensor]] = {s: [] for s in sites}
    pos: dict[str, list[torch.Tensor]] = {s: [] for s in sites}
    handles = [model.register_forward_pre_hook(tracker.pre_hook, with_kwargs=True)]

    def record(name, stream):
        rows[name].append(stream[0].detach().float().clone())
        pos[name].append(tracker.current.clone())

    stash: dict[int, torch.Tensor] = {}
    for name in sites:
        site = parse_site(name, len(layers))
        mod = layers[site.layer]
        if site.kind == "resid_pre":
            def pre(module, args, kwargs, name=name):
                record(name, args[0] if args else kwargs["hidden_states"])
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        elif site.kind == "resid_post":
            def post(module, args, output, name=name):
                record(name, output[0] if isinstance(output, tuple) else output)
            handles.append(mod.register_forward_hook(post))
        else:
            def keep(module, args, kwargs, layer=site.layer):
                stash[layer] = args[0] if args else kwargs["hidden_states"]
            def attn(module, args, output, name=name, layer=site.layer):
                out = output[0] if isinstance(output, tuple) else output
                record(name, stash[layer] + out)
            handles.append(mod.register_forward_pre_hook(keep, with_kwargs=True))
            handles.append(mod.self_attn.register_forward_hook(attn))
    try:
        tokens, _ = hf_generate(model, prompt_ids, max_new_tokens)
    finally:
        for h in handles:
            h.remove()
    return ({s: torch.cat(rows[s]) for s in sites}, {s: torch.cat(pos[s]) for s in sites},
            tokens)


def hf_capture_attention(model, prompt_ids: list[int], max_new_tokens: int, layer: int):
    """q and k after RoPE, v, and z (per-head input of o_proj) of one layer, for every
    position that ran: ({"q"|"k"|"v"|"z": [P, heads, head_dim]}, positions)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = model.model.layers[layer].self_attn
    d = attn.head_dim
    tracker = _PositionTracker()
    got: dict[str, list[torch.Tensor]] = {k: [] for k in "qkvz"}
    positions: list[torch.Tensor] = []
    stash: dict[str, torch.Tensor] = {}

    def pre(module, args, kwargs):
        stash["cos"], stash["sin"] = kwargs["position_embeddings"]

    def proj(name):
        def hook(module, args, output):
            stash[name] = output[0].float().reshape(output.shape[1], -1, d)
        return hook

    def o_in(module, args):
        got["z"].append(args[0][0].float().reshape(args[0].shape[1], -1, d).clone())

    def done(module, args, output):
        q, k = stash["q"].transpose(0, 1)[None], stash["k"].transpose(0, 1)[None]
        q, k = apply_rotary_pos_emb(q, k, stash["cos"].float(), stash["sin"].float())
        got["q"].append(q[0].transpose(0, 1).clone())
        got["k"].append(k[0].transpose(0, 1).clone())
        got["v"].append(stash["v"].clone())
        positions.append(tracker.current.clone())

    handles = [model.register_forward_pre_hook(tracker.pre_hook, with_kwargs=True),
               attn.register_forward_pre_hook(pre, with_kwargs=True),
               attn.q_proj.register_forward_hook(proj("q")),
               attn.k_proj.register_forward_hook(proj("k")),
               attn.v_proj.register_forward_hook(proj("v")),
               attn.o_proj.register_forward_pre_hook(o_in),
               attn.register_forward_hook(done)]
    try:
        hf_generate(model, prompt_ids, max_new_tokens)
    finally:
        for h in handles:
            h.remove()
    return {k: torch.cat(v) for k, v in got.items()}, torch.cat(positions)


def hf_attention_pattern(model, ids: list[int], layer: int) -> torch.Tensor:
    """One layer's attention probabilities over a whole sequence with HF's eager attention
    (the one that returns them): [query position, heads, key position], float32."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    return out.attentions[layer][0].transpose(0, 1).float()
