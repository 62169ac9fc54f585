"""The reference placement and its noise-floor variants: on a GPU that holds the whole model, else the CPU."""

from __future__ import annotations

from pathlib import Path

from artifacts.model_info import model_info
from tasks.testing import h200_report
from tasks.validation.outputs import floor_variants, reference_placement


def test_a_gpu_that_holds_the_model_computes_the_reference(tiny_moe: Path) -> None:
    info, hw = model_info(tiny_moe), h200_report(1)
    ref = reference_placement(info, hw, 512, 8, 0)
    assert ref.n_gpu_layers == -1 and not ref.flash_attn and ref.type_k == "f16"
    names = [n for n, _ in floor_variants(info, hw, ref)]
    assert names == ["CPU, plain layout, flash attention, n_ubatch 64", "CUDA0, flash attention, n_ubatch 64"]
    cpu = dict(floor_variants(info, hw, ref))[names[0]]
    assert cpu.n_gpu_layers == 0 and not cpu.repack and cpu.flash_attn


def test_without_room_on_a_gpu_the_cpu_computes_it(tiny_moe: Path) -> None:
    info = model_info(tiny_moe)
    for hw in (h200_report(1, free_gib=0.001), h200_report(0)):
        ref = reference_placement(info, hw, 512, 8, 0)
        assert ref.n_gpu_layers == 0 and not ref.repack
        variants = dict(floor_variants(info, hw, ref))
        assert variants["CPU, repacked layout, flash attention, n_ubatch 64"].repack
