"""uacompile.build's manifest lookup: load_manifest by symbol per (target, lowering), paths resolved inside the
folder, one-line errors; preset_of / build_command. No build: manifests are written here."""
import json

import pytest

from uacompile import ir
from uacompile.build import MODELS, build_command, load_manifest, preset_of
from uacompile.lower.config import TVMConfig


def write_manifest(folder, entries):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({"uacompile": "0", "targets": ["cuda"], "kernels": entries}))


def entry(target, lowering, symbol, library, built_in):
    return {"op": "copy_blocks", "target": target, "lowering": lowering, "symbol": symbol, "params": {},
            "library": None if library is None else str(built_in / target / lowering / library),
            "source": str(built_in / target / lowering / "k.cu"), "reason": None if library else "nvcc not found"}


def test_lookup_is_per_lowering_and_resolves_inside_the_folder(tmp_path):
    elsewhere = tmp_path / "built-on-another-machine"
    write_manifest(tmp_path / "carried", [
        entry("cuda", "jinja", "ua_copy_blocks_1", "ua_copy_blocks_1_sm_90.so", elsewhere),
        entry("cuda", "tvm", "ua_copy_blocks_1", "ua_copy_blocks_1_sm_90.so", elsewhere),
        entry("cuda", "tvm", "ua_swap_blocks_2", None, elsewhere),
        entry("cpu", "tvm", "ua_copy_blocks_1", "ua_copy_blocks_1.so", elsewhere),
    ])
    tvm = load_manifest(tmp_path / "carried", "cuda", "tvm")
    assert set(tvm) == {"ua_copy_blocks_1", "ua_swap_blocks_2"}
    assert tvm["ua_copy_blocks_1"]["library"] == str(tmp_path / "carried/cuda/tvm/ua_copy_blocks_1_sm_90.so")
    assert tvm["ua_copy_blocks_1"]["source"] == str(tmp_path / "carried/cuda/tvm/k.cu")
    assert tvm["ua_swap_blocks_2"]["library"] is None and tvm["ua_swap_blocks_2"]["reason"] == "nvcc not found"
    jinja = load_manifest(tmp_path / "carried", "cuda", "jinja")
    assert jinja["ua_copy_blocks_1"]["library"] == str(tmp_path / "carried/cuda/jinja/ua_copy_blocks_1_sm_90.so")
    assert set(load_manifest(tmp_path / "carried", "cpu", "tvm")) == {"ua_copy_blocks_1"}


@pytest.mark.parametrize("content,needle", [
    (None, "does not exist: make the folder with `uacompile build --target cuda"),
    ("{not json", "not a uacompile build manifest (JSONDecodeError"),
    ("[1, 2]", "not a uacompile build manifest (TypeError"),
    ('{"targets": []}', "not a uacompile build manifest (KeyError"),
])
def test_a_bad_folder_is_a_one_line_error(tmp_path, content, needle):
    if content is not None:
        (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(ValueError) as e:
        load_manifest(tmp_path, "cuda", "tvm")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_build_command_names_the_smallest_preset_holding_the_kernel():
    attention = MODELS["stories260k"].ops()[0]
    kernel = ir.Kernel(attention, TVMConfig())
    assert preset_of(kernel, "cuda", "tvm") == "tiny"
    assert build_command(kernel, "cuda", "tvm", "out") == "uacompile build --preset tiny --target cuda --out out"
    assert preset_of(ir.Kernel(MODELS["llama3-8b"].ops()[0], TVMConfig()), "cuda", "tvm") == "llama3-8b"
    assert build_command(ir.Kernel(attention.replace(head_dim=24), TVMConfig()), "cuda", "tvm", "out") is None
