"""The pure-Python xclbin reader and the manifest validation, on synthetic xclbins built byte by
byte in ``xclbin_files`` (a valid one, wrong magic, truncated section table, missing kernel, wrong
argument order)."""

from __future__ import annotations

import json
import struct
import uuid

import pytest

from flm_runtime.backends.npu import manifest as mf
from flm_runtime.backends.npu.xclbin import IP_PS_KERNEL, XclbinError, read_xclbin

from xclbin_files import HEAD_ARGS, LAYER_ARGS, build_xclbin, kernel_xml, write_build

UID = "4f2c3a10-8d7e-4b6a-9c5d-0e1f2a3b4c5d"


def test_reads_a_valid_xclbin():
    data = build_xclbin({"flm_decode_layer": LAYER_ARGS, "flm_lm_head": HEAD_ARGS}, uid=UID)
    x = read_xclbin(data)
    assert x.uuid == UID
    assert x.length == len(data)
    assert x.version == "2.19.7"
    assert x.platform_vbnv == "xilinx_v1_ipu_0_0"
    assert [s.kind_name for s in x.sections] == ["EMBEDDED_METADATA", "IP_LAYOUT", "AIE_PARTITION"]
    k = x.kernels["flm_decode_layer"]
    assert k.type == "dpu"
    assert k.arg_names == tuple(n for n, _ in LAYER_ARGS)
    assert [a.index for a in k.args] == list(range(len(LAYER_ARGS)))
    assert (k.args[0].type, k.args[0].address_qualifier, k.args[0].size) == ("uint64_t", 0, 8)
    assert (k.args[1].type, k.args[1].address_qualifier, k.args[1].offset) == ("char *", 1, 8)
    assert [ip.name for ip in x.instances_of("flm_lm_head")] == ["flm_lm_head:FLM_LM_HEADINST"]
    assert x.instances_of("flm_lm_head")[0].type == IP_PS_KERNEL


def test_argument_order_comes_from_ids_not_xml_order():
    """XRT sorts arguments by ``id``; the reader must too, whatever order the XML lists them in."""
    xml = kernel_xml({"k": LAYER_ARGS}).decode()
    start, end = xml.index("<arg "), xml.index("<instance")
    args = [a.strip() for a in xml[start:end].strip().split("\n")]
    shuffled = xml[:start] + "\n".join(reversed(args)) + "\n" + xml[end:]
    x = read_xclbin(build_xclbin({"k": LAYER_ARGS}, metadata=shuffled.encode()))
    assert x.kernels["k"].arg_names == tuple(n for n, _ in LAYER_ARGS)


def test_wrong_magic():
    data = build_xclbin({"k": LAYER_ARGS}, magic=b"xclbin0\0")
    with pytest.raises(XclbinError, match=r"not an xclbin: magic b'xclbin0\\x00', expected b'xclbin2\\x00'"):
        read_xclbin(data)


def test_truncated_section_table(tmp_path):
    data = build_xclbin({"k": LAYER_ARGS})
    path = tmp_path / "cut.xclbin"
    path.write_bytes(data[: 456 + 40 + 12])  # one whole section header and part of the next
    with pytest.raises(XclbinError, match=r"cut.xclbin is truncated: its section table \(3 sections\) "
                                          r"ends at byte 576, the file has 508 bytes"):
        read_xclbin(path)


def test_truncated_section_body():
    data = build_xclbin({"k": LAYER_ARGS})
    with pytest.raises(XclbinError, match=r"truncated: the header records \d+ bytes"):
        read_xclbin(data[:-200])
    # With the recorded length shrunk too, the section that runs past the end is named.
    cut = bytearray(data[:-200])
    struct.pack_into("<Q", cut, 304, len(cut))
    with pytest.raises(XclbinError, match=r"section 1 \(IP_LAYOUT\) spans bytes 1872\.\.1960, the file has 1944"):
        read_xclbin(bytes(cut))


def test_shorter_than_header_and_bad_xml():
    with pytest.raises(XclbinError, match="shorter than the 456-byte axlf header"):
        read_xclbin(b"xclbin2\0" + b"\0" * 100)
    assert read_xclbin(build_xclbin({})).kernels == {}
    broken = kernel_xml({"k": LAYER_ARGS}).replace(b"</project>", b"</projec>")
    with pytest.raises(XclbinError, match="EMBEDDED_METADATA is not valid XML"):
        read_xclbin(build_xclbin({"k": LAYER_ARGS}, metadata=broken))


# ---- validation against the manifest ------------------------------------------------------

def write_manifest(folder, kernels: dict, **geometry) -> mf.Manifest:
    """The repository's manifest with one build for ``tiny:1m`` whose files are in ``folder``."""
    raw = json.loads((mf.xclbin_dir() / "manifest.json").read_text())
    geo = dict(E=64, H=4, Hkv=2, D=16, F=96, V=266, L=2, max_positions=128, rope_theta=10000.0,
               rms_norm_eps=1e-5)
    geo.update(geometry)
    raw["builds"] = [{"model": "tiny:1m", "geometry": geo, "kernels": kernels}]
    (folder / "manifest.json").write_text(json.dumps(raw))
    return mf.load_manifest(folder / "manifest.json")


def test_a_valid_build_validates(tmp_path):
    manifest = write_manifest(tmp_path, write_build(tmp_path))
    check = mf.validate_build(manifest, "tiny:1m")
    assert check.ok, check.summary()
    assert [k.role for k in check.kernels] == ["decode_layer", "verify_layer", "lm_head"]
    assert all(uuid.UUID(k.uuid) for k in check.kernels)


def test_missing_kernel(tmp_path):
    kernels = write_build(tmp_path)
    kernels["lm_head"]["kernel"] = "flm_lm_head_v2"
    check = mf.validate_build(write_manifest(tmp_path, kernels), "tiny:1m")
    assert not check.ok
    assert check.summary() == ("lm_head: kernel 'flm_lm_head_v2' is missing from lm_head.xclbin "
                               "(its kernels: flm_lm_head)")


def test_wrong_argument_order(tmp_path):
    swapped = list(LAYER_ARGS)
    swapped[5], swapped[6] = swapped[6], swapped[5]  # weights <-> kv
    kernels = write_build(tmp_path, layer_args=swapped)
    check = mf.validate_build(write_manifest(tmp_path, kernels), "tiny:1m")
    problems = {k.role: k.problems for k in check.kernels}
    assert problems["lm_head"] == []
    assert problems["decode_layer"] == [
        "kernel 'flm_decode_layer' has the right arguments in the wrong order: argument 5 is 'kv', "
        "the manifest expects 'weights' (expected order: opcode, instr, ninstr, x_in, x_out, weights, "
        "kv, step; decode_layer.xclbin has: opcode, instr, ninstr, x_in, x_out, kv, weights, step)"]


def test_wrong_argument_set_and_type(tmp_path):
    head = HEAD_ARGS[:-1] + [("scratch", "void*")]
    layer = [("opcode", "uint32_t")] + LAYER_ARGS[1:]
    kernels = write_build(tmp_path, layer_args=layer, head_args=head)
    check = mf.validate_build(write_manifest(tmp_path, kernels), "tiny:1m")
    problems = {k.role: k.problems for k in check.kernels}
    assert problems["decode_layer"] == ["kernel 'flm_decode_layer' argument 0 'opcode' has type "
                                        "'uint32_t', the manifest expects 'uint64_t'"]
    assert problems["lm_head"][0].startswith("kernel 'flm_lm_head' arguments do not match the role "
                                             "lm_head: missing ['step'], unexpected ['scratch']")


def test_uuid_instance_and_instruction_checks(tmp_path):
    kernels = write_build(tmp_path, words=0)
    kernels["decode_layer"]["uuid"] = UID
    (tmp_path / "verify_layer.xclbin").write_bytes(
        build_xclbin({"flm_verify_layer": LAYER_ARGS}, ip_names=["other:X"]))
    check = mf.validate_build(write_manifest(tmp_path, kernels), "tiny:1m")
    problems = {k.role: k.problems for k in check.kernels}
    assert any(f"the manifest records {UID}" in p for p in problems["decode_layer"])
    assert "kernel 'flm_verify_layer' in verify_layer.xclbin has no compute-unit instance in IP_LAYOUT" \
        in problems["verify_layer"]
    assert any("is not a non-empty whole number of 32-bit words (0 bytes)" in p for p in problems["lm_head"])


def test_no_build_and_missing_role(tmp_path):
    kernels = write_build(tmp_path)
    del kernels["verify_layer"]
    manifest = write_manifest(tmp_path, kernels)
    assert mf.validate_build(manifest, "tiny:1m").problems == [
        "the build for tiny:1m lacks the required role verify_layer"]
    other = mf.validate_build(manifest, "smollm2:135m")
    assert other.build is None and "has no kernel build for smollm2:135m" in other.summary()


def test_shipped_manifest_says_nothing_is_shipped():
    manifest = mf.load_manifest()
    assert manifest.shipped is False and manifest.builds == ()
    assert "No xclbin is shipped" in manifest.status
    check = mf.validate_build(manifest, "smollm2:135m")
    assert not check.ok and check.summary().endswith("has no kernel build for smollm2:135m; no xclbin is shipped")
    assert set(manifest.roles) == {"decode_layer", "verify_layer", "prefill_layer", "lm_head"}
    assert [r for r, s in manifest.roles.items() if s.required] == ["decode_layer", "verify_layer", "lm_head"]
    assert [a.name for a in manifest.roles["verify_layer"].args] == [n for n, _ in LAYER_ARGS]
    assert [a.name for a in manifest.roles["lm_head"].args] == [n for n, _ in HEAD_ARGS]


def test_layout_shapes_evaluate_the_manifest_expressions():
    manifest = mf.load_manifest()
    geo = dict(E=576, H=9, Hkv=3, D=64, F=1536, V=49152)
    assert manifest.layout_shapes("layer_weights", geo) == [
        ("attn_norm", (576,)), ("wqkv", ((9 + 6) * 64, 576)), ("wo", (576, 576)), ("ffn_norm", (576,)),
        ("w_gate_up", (3072, 576)), ("w_down", (576, 1536))]
    with pytest.raises(mf.ManifestError, match="cannot evaluate"):
        mf.eval_dim("E ** 2", geo)
