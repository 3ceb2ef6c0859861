"""Engine-scoped state: two hooked engines in one process keep separate slots, tables and
routing. Model code finds its engine's hook manager through the slots object of that
engine's config, and graph ops find the running engine's tables through its forward
context; nothing is kept in module globals, so one engine's requests can never steer,
or be captured by, another's forward (the class of bug once fixed for the
frontend alone)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import vector

SITE = "blocks.2.hook_resid_post"


def engine_config(path, **hook_config):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(path), dtype="float32", max_model_len=64, max_num_seqs=4,
                      max_num_batched_tokens=64, enforce_eager=True, hook_manager="graphtap",
                      hook_config={"sites": [SITE], **hook_config}).create_engine_config()


def batch(req_ids, tokens_each=3):
    n = len(req_ids) * tokens_each
    qsl = np.arange(0, n + 1, tokens_each, dtype=np.int32)
    return SimpleNamespace(
        req_ids=list(req_ids), num_reqs=len(req_ids), num_tokens=n, num_tokens_after_padding=n,
        query_start_loc_np=qsl, query_start_loc=torch.from_numpy(qsl),
        idx_mapping=torch.arange(len(req_ids), dtype=torch.int32),
        idx_mapping_np=np.arange(len(req_ids)), positions=torch.arange(n) % tokens_each,
        num_scheduled_tokens=np.full(len(req_ids), tokens_each),
        num_computed_tokens_np=np.zeros(len(req_ids), dtype=np.int64))


@pytest.fixture(scope="module")
def two_engines(llama_path):
    from vllm.model_executor.layers.hook_slots import hook_slots
    from vllm.v1.worker.gpu.hooks import init_hook_manager

    configs = [engine_config(llama_path), engine_config(llama_path, max_vectors=2)]
    managers = [init_hook_manager(c, None, torch.device("cpu")) for c in configs]
    return configs, managers, [hook_slots(c) for c in configs]


def test_each_engine_has_its_own_slots_and_tables(two_engines):
    configs, managers, slots = two_engines
    assert slots[0] is not slots[1]
    assert [s.target for s in slots] == managers
    a, b = (m.op_tables for m in managers)
    assert a is not b and a.steer.bank.data_ptr() != b.steer.bank.data_ptr()
    assert (a.steer.bank.shape[0], b.steer.bank.shape[0]) == (65, 3)  # max_vectors + 1


def test_ops_act_on_the_running_engines_tables_only(two_engines):
    """The same request id steers in engine A; engine B has it without hooks. The same
    op call, under each engine's forward context, edits the stream only under A's."""
    from vllm import SamplingParams
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.gpu.hooks import current_hook_manager

    configs, managers, slots = two_engines
    hooks = {"steer": [{"site": SITE, "op": "add", "scale": 3.0, "vector": vector(256, 1)}]}
    for config, manager, spec in zip(configs, managers, (hooks, None)):
        params = SamplingParams(max_tokens=4, hooks=spec)
        manager.frontend(config).process_request("r", params, None)
        manager.add_request(0, SimpleNamespace(req_id="r", prompt_len=3, sampling_params=params))
        manager.apply_staged_writes()
        manager.prepare_step(batch(["r"]), dummy_run=False)
    site = managers[0].sites.id_for_slot(2, "resid_post")
    x = torch.randn(3, 256)
    got = []
    for config, manager in zip(configs, managers):
        with set_forward_context(None, config):
            assert current_hook_manager() is manager
            y = x.clone()
            torch.ops.graphtap.steer_resid_(y, None, torch.arange(3), site)
            # and through the model-side slot, as a decoder layer calls it when traced
            z = x.clone()
            slots[configs.index(config)].residual(2, "resid_post", torch.arange(3), z, None)
            assert torch.equal(y, z)
        got.append(y)
    v = torch.tensor(vector(256, 1))
    torch.testing.assert_close(got[0], x + 3.0 * v)
    assert torch.equal(got[1], x)
    assert managers[0].op_tables.python_calls["steer_resid_"] == 2
    assert managers[1].op_tables.python_calls["steer_resid_"] == 2


def test_an_op_outside_a_graphtap_engine_fails_loudly(llama_path):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import set_forward_context

    plain = EngineArgs(model=str(llama_path), dtype="float32", max_model_len=64,
                       enforce_eager=True).create_engine_config()
    with set_forward_context(None, plain), pytest.raises(RuntimeError, match="no graphtap"):
        torch.ops.graphtap.steer_resid_(torch.zeros(1, 256), None, torch.zeros(1), 0)


def test_router_copies_positions_only_for_steps_that_steer_heads(llama_path):
    """Review finding: with a z site configured, the router copied every step's
    positions into tok_pos even when no request steered heads (the only reader)."""
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.hooks import init_hook_manager

    z = "blocks.1.attn.hook_z"
    config = engine_config(llama_path, sites=[SITE, z])
    manager = init_hook_manager(config, None, torch.device("cpu"))
    frontend = manager.frontend(config)
    specs = {"resid": {"steer": [{"site": SITE, "op": "add", "vector": vector(256, 2)}]},
             "heads": {"steer": [{"site": z, "op": "scale", "heads": [1], "scale": 0.0}]}}
    for slot, (req, spec) in enumerate(specs.items()):
        params = SamplingParams(max_tokens=4, hooks=spec)
        frontend.process_request(req, params, None)
        manager.add_request(slot, SimpleNamespace(req_id=req, prompt_len=3,
                                                  sampling_params=params))
    manager.apply_staged_writes()
    tok_pos = manager.op_tables.tok_pos
    tok_pos.fill_(-7)
    manager.prepare_step(batch(["resid"]), dummy_run=False)
    assert (tok_pos == -7).all()
    manager.prepare_step(batch(["resid", "heads"]), dummy_run=False)
    assert tok_pos[:6].tolist() == [0, 1, 2, 0, 1, 2]


def test_default_capture_rows_fit_a_step_captured_everywhere(two_engines, llama_path):
    """Issue 18: capture_rows defaults to the largest step (max_num_batched_tokens, 64
    here) times the sites one request may capture (max_captures, at most the configured
    row sites; patterns have their own buffer), so a Q/K capture of a full prefill step
    does not overflow by default; an explicit capture_rows wins."""
    from graphtap.config import HookConfig
    from graphtap.spec.sites import SiteTable, expand_patterns

    _, managers, _ = two_engines
    assert managers[0].op_tables.capture.rows == 64  # one configured site
    qk = SiteTable(expand_patterns([f"blocks.{i}.attn.hook_{k}" for i in range(4) for k in "qk"]
                                   + ["blocks.1.attn.hook_pattern"], 4))
    assert HookConfig().capture_rows_for(qk, 8192) == 8 * 8192
    assert HookConfig(max_captures=2).capture_rows_for(qk, 8192) == 2 * 8192
    assert HookConfig(capture_rows=100).capture_rows_for(qk, 8192) == 100
