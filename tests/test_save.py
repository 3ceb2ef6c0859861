"""`save_to` files without an engine (issue 16, item 7): whatever fails, the request's
save fails with a reason and nothing else happens; files appear whole or not at all."""
import os

import torch
from safetensors.torch import load_file

from graphtap.courier.save import Saver, file_name
from graphtap.outputs import HookOutputs

SITE = "blocks.1.hook_resid_post"


def outputs(rows=3):
    return HookOutputs({SITE: torch.arange(rows * 4.0).view(rows, 4)},
                       {SITE: torch.arange(rows)})


def test_saves_atomically_under_a_bounded_name(tmp_path):
    out = outputs()
    long_id = "cmpl-" + "x" * 300 + "/../é"
    Saver(str(tmp_path), 2**20).save("a/b", long_id, out)
    assert out.save_error is None, out.save_error
    path = tmp_path / out.saved_to
    assert len(path.name) < 128 and path.parent == tmp_path / "a" / "b"
    assert torch.equal(load_file(path)[SITE], out[SITE])
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    assert file_name(long_id) != file_name(long_id + "y")  # the hash tells ids apart


def test_failures_fail_the_save_only(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "afile").write_text("x")
    (root / "alink").symlink_to(tmp_path)
    saver = Saver(str(root), 2**20)
    for relative in ("afile/x", "alink", "alink/x"):
        out = outputs()
        saver.save(relative, "r", out)
        assert out.saved_to is None and out.save_error.startswith("hooks.save_to: not saved")
        assert out[SITE].shape == (3, 4)  # the captures are still there
    assert sorted(os.listdir(tmp_path)) == ["root"]  # nothing written through the link
    gone = Saver(str(tmp_path / "deleted"), 2**20)
    out = outputs()
    gone.save("x", "r", out)
    assert "No such file" in out.save_error
    assert saver.written == 0  # failed saves do not count against the quota


def test_the_quota_bounds_what_a_server_writes(tmp_path):
    saver = Saver(str(tmp_path), 400)  # one file of ~270 bytes
    first, second = outputs(), outputs()
    saver.save("q", "r1", first)
    saver.save("q", "r2", second)
    assert first.save_error is None and "hook_config.save_quota_bytes" in second.save_error
    assert len(list((tmp_path / "q").iterdir())) == 1


def test_a_file_where_the_name_is_a_directory_fails_cleanly(tmp_path):
    (tmp_path / "d" / file_name("r")).mkdir(parents=True)
    out = outputs()
    Saver(str(tmp_path), 2**20).save("d", "r", out)
    assert out.save_error and out.saved_to is None
    assert os.listdir(tmp_path / "d") == [file_name("r")]  # its temporary was removed


def test_the_wire_carries_where_it_was_saved_or_why_not():
    from graphtap.wire import decode, encode

    for encoding in ("raw", "safetensors"):
        out = outputs()
        out.encoding, out.save_error = encoding, "hooks.save_to: not saved: No space left"
        back = decode(encode(out))
        assert back.save_error == out.save_error and back.saved_to is None
        assert torch.equal(back[SITE], out[SITE])
        out.save_error, out.saved_to = None, "run/r-abc.safetensors"
        assert decode(encode(out)).saved_to == "run/r-abc.safetensors"
