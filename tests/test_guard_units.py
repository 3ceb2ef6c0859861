"""Guards without an engine: the spec (what a guard needs, refusals naming the field),
verdicts on step chunks (attention focus at the last prompt token, probe at generated
positions), the FINISH key vLLM's scheduler reads, and the decisive verdict at finish."""
import pytest
import torch

from graphtap.courier import assemble
from graphtap.courier.chunks import FINISH, positions_key
from graphtap.courier.guard import apply_guards
from graphtap.spec import ModelShape, normalise, parse_spec

H = 16
SHAPE = ModelShape(num_layers=2, hidden_size=H, max_model_len=64, max_steers=1, max_vectors=4,
                   num_heads=4, num_kv_heads=2, head_dim=4,
                   configured_sites={"blocks.1.attn.hook_pattern", "blocks.1.hook_resid_post",
                                     "blocks.0.attn.hook_pattern"})
PAT, RES = "blocks.1.attn.hook_pattern", "blocks.1.hook_resid_post"
MASS = {"site": PAT, "spans": [{"start": 0, "end": 3}, {"start": 3, "end": 10}]}
PROBE = {"site": RES, "weights": [[1.0] * H, [0.5] * H], "positions": "generated"}


def spec(**kw):
    return normalise(parse_spec(kw), SHAPE)


def test_vllm_finishes_a_request_whose_sealed_chunk_holds_the_finish_key():
    from vllm.v1.worker.gpu.hooks import hook_finishes

    from graphtap.courier.payload import open_payload, seal

    stop = seal({FINISH: torch.ones(1, dtype=torch.int8), "x": torch.ones(2)})
    assert hook_finishes({"r": stop}, "r") and FINISH in open_payload(stop)
    assert not hook_finishes({"r": seal({"x": torch.ones(2)})}, "r")
    assert not hook_finishes({"r": seal({})}, "r") and not hook_finishes(None, "r")


def test_guard_entries():
    g = spec(attention_mass=[MASS], guard={"kind": "attention_focus", "threshold": 0.4,
                                           "action": "stop"}).guard
    assert (g.kind, g.threshold, g.stop, g.sources) == ("attention_focus", 0.4, True,
                                                         (f"mass:{PAT}",))
    g = spec(probe=[PROBE], guard={"kind": "probe", "threshold": 2.0, "column": 1}).guard
    assert (g.sources, g.column, g.stop) == ((f"probe:{RES}",), 1, False)


@pytest.mark.parametrize("kw, field, words", [
    (dict(guard={"kind": "attention_focus", "threshold": 0.5}), "hooks.guard",
     "there are none"),
    (dict(attention_mass=[{**MASS, "spans": MASS["spans"][:1]}],
          guard={"kind": "attention_focus", "threshold": 0.5}), "hooks.guard", "two spans"),
    (dict(attention_mass=[{**MASS, "positions": "generated"}],
          guard={"kind": "attention_focus", "threshold": 0.5}), "hooks.guard", "last prompt"),
    (dict(attention_mass=[MASS], guard={"kind": "attention_focus", "threshold": 0.5,
                                        "site": "blocks.0.attn.hook_pattern"}),
     "hooks.guard", "at blocks.0.attn.hook_pattern"),
    (dict(guard={"kind": "probe", "threshold": 0.5}), "hooks.guard", "there is none"),
    (dict(probe=[PROBE], guard={"kind": "probe", "threshold": 0.5, "column": 2}),
     "hooks.guard.column", "has 2 scores"),
    (dict(probe=[{**PROBE, "positions": "last_prompt"}], guard={"kind": "probe",
                                                                "threshold": 0.5}),
     "hooks.guard", "generated"),
    (dict(probe=[PROBE], guard={"kind": "probe", "threshold": float("inf")}),
     "hooks.guard.threshold", "finite"),
    (dict(probe=[PROBE], guard={"kind": "probe", "threshold": 1.0, "action": "kill"}),
     "hooks.guard.action", "'annotate'"),
])
def test_invalid_guards_name_the_field(kw, field, words):
    with pytest.raises(ValueError) as e:
        spec(**kw)
    assert str(e.value).startswith(field) and words in str(e.value), str(e.value)


def _mass_chunk(positions, focus):
    """Masses whose focus (span 0 over spans 0 + 1) is `focus` at every head."""
    name = f"mass:{PAT}"
    m = torch.zeros(len(positions), 2, 2)
    m[..., 0], m[..., 1] = focus, 1 - focus
    return {name: m, positions_key(name): torch.tensor(positions)}


def test_focus_guard_flags_and_stops_at_the_last_prompt_token():
    g = spec(attention_mass=[MASS], guard={"kind": "attention_focus", "threshold": 0.5,
                                           "action": "stop"}).guard
    low, high = _mass_chunk([3, 4], 0.25), _mass_chunk([3, 4], 0.75)
    early = _mass_chunk([0, 1], 0.1)  # a chunk of the prompt without its last token
    out = {"a": low, "b": high, "c": early}
    apply_guards(out, {"a": (g, 5), "b": (g, 5), "c": (g, 5)})
    assert FINISH in out["a"] and FINISH not in out["b"] and FINISH not in out["c"]
    done = assemble([low], g, prompt_len=5)
    assert done.guard == {"kind": "attention_focus", "threshold": 0.5, "action": "stop",
                          "score": 0.25, "position": 4, "flagged": True}
    assert assemble([high], g, prompt_len=5).guard["flagged"] is False


def test_probe_guard_takes_the_first_flagged_generated_position():
    g = spec(probe=[PROBE], guard={"kind": "probe", "threshold": 1.0, "column": 1}).guard
    name = f"probe:{RES}"
    steps = [{name: torch.tensor([[9.0, 0.5], [9.0, 0.75]]), positions_key(name): torch.tensor([5, 6])},
             {name: torch.tensor([[0.0, 1.5], [0.0, 2.5]]), positions_key(name): torch.tensor([7, 8])},
             {name: torch.tensor([[0.0, 9.0]]), positions_key(name): torch.tensor([9])}]
    for chunk in steps:
        apply_guards({"r": chunk}, {"r": (g, 5)})
    assert not any(FINISH in c for c in steps)  # annotate: nothing stops
    verdict = assemble(steps, g, prompt_len=5).guard
    assert (verdict["score"], verdict["position"], verdict["flagged"]) == (1.5, 7, True)
    quiet = assemble(steps[:1], g, prompt_len=5).guard
    assert (quiet["score"], quiet["position"], quiet["flagged"]) == (0.75, 6, False)
    assert assemble([{}], g, prompt_len=5).guard["score"] is None  # no generated row came
    # out of order (a recomputation): the verdict reads positions, not arrival order
    late = assemble([steps[1], steps[0]], g, prompt_len=5).guard
    assert (late["score"], late["position"]) == (1.5, 7)
    stop = spec(probe=[PROBE], guard={"kind": "probe", "threshold": 1.0, "column": 1,
                                      "action": "stop"}).guard
    chunk = dict(steps[1])
    apply_guards({"r": chunk}, {"r": (stop, 5)})
    assert FINISH in chunk
