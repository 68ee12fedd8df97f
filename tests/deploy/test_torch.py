"""bevcompile.torch: GridGather and MatrixLift against independent references.

GridGather is compared with ``torch.nn.functional.grid_sample`` itself on ``grid/norm``;
MatrixLift with ``W @ X`` from the stored COO (scipy, float64) and, for the frustum with
``--topk 0 --splat nearest --normalize sum``, with a straightforward scatter-add LSS pooling
(:func:`bevcompile.interop.reference_frustum_pool`, which never looks at the matrix).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bevcompile.deploy.onnx_export import make_inputs, reference_matrix_lift
from bevcompile.errors import StoreError, UsageError
from bevcompile.grid.build import run_grid
from bevcompile.grid.gather import build_gather_tables
from bevcompile.grid.ipm import compute_sampling_grid
from bevcompile.interop.bevpoolv2 import BevPoolOptions, reference_frustum_pool
from bevcompile.matrix.build import MatrixOptions, run_matrix
from bevcompile.rig.config import RigConfig
from bevcompile.store.loader import load, matrix_layout
from bevcompile.torch import GridGather, LearnableLift, MatrixLift, bilinear_tables_from_norm

from ..grid.test_build import region_grid_stores  # the small rig with and without tests/matrix/test_region.REGION

ROOT = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------------------
# store builders (shared with test_onnx_export / test_export_cli)
# --------------------------------------------------------------------------------------


def build_grid_store(rig: RigConfig, out: Path, *, align_corners: bool = False, npu: bool = False, align: int = 1, order: str = "row") -> Path:
    """``bevcompile grid`` into ``out`` (``npu=True`` also writes gather/ with ``--align``/``--order``)."""
    return run_grid(rig, out, align_corners=align_corners, npu=npu, align=align, order=order).store


def add_matrix_group(store: Path, rig: RigConfig, options: MatrixOptions) -> None:
    """``bevcompile matrix`` with ``options`` into the same store (``run_matrix``)."""
    assert run_matrix(rig, store.parent, options).store == store


def torch_grid_sample_reference(store: Path, features: torch.Tensor) -> torch.Tensor:
    """Per camera ``F.grid_sample`` on ``grid/norm``: ``(N, n_cam, C, n_h, ny, nx)`` float64."""
    loaded = load(store)
    norm = torch.from_numpy(np.array(loaded["grid"]["norm"], dtype=np.float64))
    align = bool(loaded["grid"].attrs["align_corners"])
    n, n_cam, c = features.shape[:3]
    _, n_h, ny, nx, _ = norm.shape
    out = []
    for cam in range(n_cam):
        grid = norm[cam].reshape(1, n_h * ny, nx, 2).expand(n, -1, -1, -1)
        sampled = F.grid_sample(features[:, cam].double(), grid, mode="bilinear", padding_mode="zeros", align_corners=align)
        out.append(sampled.reshape(n, c, n_h, ny, nx))
    return torch.stack(out, dim=1)


# --------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def multi_store(tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> Path:
    """Distorted lenses, 3 heights, partial coverage; grid only (no gather/ group)."""
    return build_grid_store(small_distorted_multi, tmp_path_factory.mktemp("multi"))


@pytest.fixture(scope="module")
def features_multi(small_distorted_multi: RigConfig) -> torch.Tensor:
    w_f, h_f = small_distorted_multi.feature_size
    return torch.rand(2, small_distorted_multi.n_cam, 5, h_f, w_f, generator=torch.Generator().manual_seed(1))


# --------------------------------------------------------------------------------------
# GridGather
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize(
    ("layout", "align", "order"), [("none", 1, "row"), ("bev", 1, "row"), ("flat", 32, "row"), ("flat_cache", 16, "cache"), ("flat_feature", 8, "feature")]
)
def test_grid_gather_equals_torch_grid_sample(
    tmp_path: Path, small_distorted_multi: RigConfig, features_multi: torch.Tensor,
    align_corners: bool, layout: str, align: int, order: str,
) -> None:
    """Sum over cameras of grid_sample on grid/norm, from gather/ in every stored layout and
    from grid/norm alone ("none": the store has no gather/ group)."""
    store = build_grid_store(small_distorted_multi, tmp_path, align_corners=align_corners, npu=layout != "none", align=align, order=order)
    module = GridGather(store)
    assert module.source == ("grid" if layout == "none" else "gather")
    assert module.layout == ("bev" if layout == "none" else layout)
    out = module(features_multi)
    ref = torch_grid_sample_reference(store, features_multi).sum(dim=1)
    assert out.shape == (2, 5, 3, 40, 40)
    assert torch.max(torch.abs(out.double() - ref)).item() < 2e-6
    # partial coverage: some cells seen by no camera at some height are exactly 0
    valid = np.asarray(load(store)["grid"]["valid"])
    unseen = torch.from_numpy(~valid.any(axis=0))
    assert unseen.any() and (~unseen).any()
    assert torch.all(out[:, :, unseen] == 0)


@pytest.mark.parametrize("source", ["gather", "grid"])
def test_grid_gather_of_a_feature_level_samples_that_levels_features(tmp_path: Path, source: str) -> None:
    """``feature.levels`` (stride 8 and 16, normalized): ``GridGather(store, level=1)`` takes the
    level-1 features ``(N, n_cam, C, 4, 6)`` and equals torch ``grid_sample`` on ``grid_l1/norm``
    (the sum over cameras); level 0 keeps the 12x8 map. A level the store lacks is a usage error."""
    from ..grid.test_build_levels import multi_level_rig

    store = run_grid(multi_level_rig(), tmp_path).store
    loaded = load(store)
    feats = torch.rand(2, 4, 3, 4, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    module = GridGather(store, level=1, source=source)
    assert module.feature_size == (6, 4) and module.source == source
    out = module(feats.float())
    norm = torch.from_numpy(np.array(loaded["grid_l1"]["norm"], dtype=np.float64))
    _, n_h, ny, nx, _ = norm.shape
    ref = sum(
        F.grid_sample(feats[:, cam], norm[cam].reshape(1, n_h * ny, nx, 2).expand(2, -1, -1, -1), align_corners=False).reshape(2, 3, n_h, ny, nx)
        for cam in range(4)
    )
    assert float(torch.abs(ref).max()) > 0.5
    assert torch.max(torch.abs(out.double() - ref)).item() < 2e-6
    assert GridGather(store).feature_size == (12, 8)
    with pytest.raises(UsageError, match=r"level must be a feature level of the store, 0 to 1, got 2"):
        GridGather(store, level=2)


def test_grid_gather_per_camera(multi_store: Path, features_multi: torch.Tensor) -> None:
    """Features of one camera only: the output is exactly that camera's grid_sample."""
    module = GridGather(multi_store)
    ref = torch_grid_sample_reference(multi_store, features_multi)  # (N, n_cam, C, n_h, ny, nx)
    for cam in range(features_multi.shape[1]):
        only = torch.zeros_like(features_multi)
        only[:, cam] = features_multi[:, cam]
        out = module(only)
        assert torch.max(torch.abs(out.double() - ref[:, cam])).item() < 2e-6
        assert ref[:, cam].abs().max() > 0.5


def test_grid_gather_mean_over_valid_cameras(multi_store: Path, features_multi: torch.Tensor) -> None:
    """reduce="mean": the sum divided by the number of cameras that see the cell (per height)."""
    valid = torch.from_numpy(np.array(load(multi_store)["grid"]["valid"]))
    count = valid.sum(dim=0)  # (n_h, ny, nx)
    assert (count > 1).any(), "the test rig must have overlapping cameras"
    out = GridGather(multi_store, reduce="mean")(features_multi)
    ref = torch_grid_sample_reference(multi_store, features_multi).sum(dim=1)
    expected = torch.where(count > 0, ref / count.clamp(min=1), torch.zeros_like(ref))
    assert torch.max(torch.abs(out.double() - expected)).item() < 2e-6
    assert torch.all(out[:, :, count == 0] == 0)


def test_grid_gather_collapse_heights(multi_store: Path, features_multi: torch.Tensor) -> None:
    """collapse_heights: sum over cameras AND heights; mean divides by the valid (camera, height) pairs."""
    valid = torch.from_numpy(np.array(load(multi_store)["grid"]["valid"]))
    ref = torch_grid_sample_reference(multi_store, features_multi).sum(dim=(1, 3))  # (N, C, ny, nx)
    out_sum = GridGather(multi_store, collapse_heights=True)(features_multi)
    assert out_sum.shape == (2, 5, 40, 40)
    assert torch.max(torch.abs(out_sum.double() - ref)).item() < 5e-6
    count = valid.sum(dim=(0, 1))
    out_mean = GridGather(multi_store, reduce="mean", collapse_heights=True)(features_multi)
    expected = torch.where(count > 0, ref / count.clamp(min=1), torch.zeros_like(ref))
    assert torch.max(torch.abs(out_mean.double() - expected)).item() < 2e-6


def test_grid_gather_buffers_are_the_store_arrays(tmp_path: Path, small: RigConfig) -> None:
    store = build_grid_store(small, tmp_path, npu=True)
    module = GridGather(store, reduce="mean")
    state = module.state_dict()
    assert set(state) == {"index", "weight", "inv_count"}
    loaded = load(store)
    assert state["index"].dtype == torch.int32 and state["weight"].dtype == torch.float32
    assert np.array_equal(state["index"].numpy(), loaded["gather"]["index"])
    assert np.array_equal(state["weight"].numpy(), loaded["gather"]["weight"])


def test_tables_from_norm_match_issue3_gather_tables(small_distorted_multi: RigConfig) -> None:
    """The fallback tables (derived from grid/norm) agree with gather/ built from float64
    coords: same indices wherever the weight is not ~0, weights within float32 rounding."""
    grid = compute_sampling_grid(small_distorted_multi)
    tables = build_gather_tables(grid)
    from bevcompile.grid.ipm import build_grid_products

    norm = build_grid_products(grid, align_corners=False).norm
    index, weight = bilinear_tables_from_norm(norm, grid.feature_size, align_corners=False)
    assert np.max(np.abs(weight - tables.weight)) < 1e-5
    strong = tables.weight > 1e-4
    assert np.array_equal(index[strong], tables.index[strong])
    assert index.min() >= 0 and index.max() < small_distorted_multi.n_cam * 12 * 8


def test_grid_gather_rejects_bad_inputs(multi_store: Path) -> None:
    module = GridGather(multi_store)
    with pytest.raises(UsageError, match=r"do not fit the store"):
        module(torch.zeros(1, 3, 2, 8, 12))
    with pytest.raises(UsageError, match="reduce"):
        GridGather(multi_store, reduce="max")
    with pytest.raises(StoreError, match=r"no group gather/"):
        GridGather(multi_store, source="gather")


def test_torch_module_import_without_torch_is_a_dependency_error() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # simulate an environment without PyTorch
        from bevcompile.errors import DependencyError
        try:
            import bevcompile.torch
        except DependencyError as exc:
            print("DEP:", exc)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "DEP:" in result.stdout and "bevcompile[torch]" in result.stdout


# --------------------------------------------------------------------------------------
# MatrixLift
# --------------------------------------------------------------------------------------

MATRIX_CASES = [
    MatrixOptions(mode="frustum", topk=8, align=4, tile_rows=32),
    MatrixOptions(mode="frustum", topk=0, splat="nearest", align=1, tile_rows=40, compact_rows=True, rounding="trunc"),
    MatrixOptions(mode="grid", topk=0, align=8, tile_rows=16, compact_rows=True),
    MatrixOptions(mode="grid", topk=4, align=1, tile_rows=1600, normalize="mean"),
]


@pytest.fixture(scope="module", params=range(len(MATRIX_CASES)), ids=lambda i: f"{MATRIX_CASES[i].mode}-k{MATRIX_CASES[i].topk}")
def matrix_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> tuple[Path, MatrixOptions]:
    options = MATRIX_CASES[request.param]
    store = build_grid_store(small_distorted_multi, tmp_path_factory.mktemp("matrix"))
    add_matrix_group(store, small_distorted_multi, options)
    return store, options


@pytest.mark.parametrize("form", ["ell", "tiles"])
def test_matrix_lift_equals_coo_product(matrix_store: tuple[Path, MatrixOptions], form: str) -> None:
    store, options = matrix_store
    loaded = load(store)
    inputs = make_inputs(loaded, channels=5, batch=2, seed=3, with_depth=options.mode == "frustum")
    module = MatrixLift(store, form=form)
    assert module.mode == options.mode
    out = module(*(torch.from_numpy(v) for v in inputs.values())).numpy()
    ref = reference_matrix_lift(loaded, inputs["features"], inputs.get("depth"))
    assert out.shape == (2, 5, 40, 40)
    assert np.abs(ref).max() > 0.1
    assert np.max(np.abs(out - ref)) < 2e-6
    if options.compact_rows:
        cells = np.zeros(40 * 40, dtype=bool)
        cells[np.asarray(loaded["matrix"]["row_ids"])] = True
        assert np.all(out.reshape(2, 5, -1)[:, :, ~cells] == 0)


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_tiles_follow_a_loaded_state_dict_after_a_dtype_or_device_move(tmp_path: Path, small_distorted_multi: RigConfig, weights: str) -> None:
    """``model.double()`` (or ``.cuda()``) then ``load_state_dict(ckpt)``: the forward must use the
    checkpoint's tables (the per-tile views stay views of the converted flat buffers)."""
    options = MatrixOptions(mode="grid", topk=4, align=4, tile_rows=100, quantize="int8" if weights == "int8" else None)
    store = build_grid_store(small_distorted_multi, tmp_path)
    add_matrix_group(store, small_distorted_multi, options)
    inputs = make_inputs(load(store), channels=3, batch=1, seed=0, with_depth=False)
    features = torch.from_numpy(inputs["features"]).double()
    module = MatrixLift(store, form="tiles", weights=weights).double()
    before = module(features)
    state = module.state_dict()
    if weights == "float32":
        state["tile_weight"] = state["tile_weight"] * 2
    else:
        state["tile_row_scale"] = state["tile_row_scale"] * 2
        for t in range(len(module.tiles)):
            state[f"tile{t}_block"] = torch.zeros_like(state[f"tile{t}_block"])
    module.load_state_dict(state)
    after = module(features)
    if weights == "float32":
        assert torch.allclose(after, 2 * before) and before.abs().max() > 0.1
    else:
        assert after.abs().max() == 0 and before.abs().max() > 0.1
    assert module.tile0_block.dtype == (torch.float64 if weights == "float32" else torch.int8)


@pytest.mark.parametrize("rounding", ["floor", "trunc"])
@pytest.mark.parametrize("form", ["ell", "tiles"])
def test_matrix_lift_frustum_equals_independent_lss_pooling(
    tmp_path: Path, small_distorted_multi: RigConfig, rounding: str, form: str
) -> None:
    """topk 0, nearest, sum: MatrixLift == scatter-add of depth x feature over the frustum."""
    rig = small_distorted_multi
    store = build_grid_store(rig, tmp_path)
    add_matrix_group(store, rig, MatrixOptions(mode="frustum", topk=0, splat="nearest", normalize="sum", align=8,
                                               tile_rows=64, rounding=rounding))
    inputs = make_inputs(load(store), channels=3, batch=1, seed=5, with_depth=True)
    out = MatrixLift(store, form=form)(torch.from_numpy(inputs["features"]), torch.from_numpy(inputs["depth"])).numpy()
    ref = reference_frustum_pool(rig, BevPoolOptions("rig", rounding), inputs["depth"][0], inputs["features"][0])
    assert ref.shape == (3, 1, 40, 40)
    assert np.abs(ref).max() > 0.1
    assert np.max(np.abs(out[0] - ref[:, 0])) < 2e-6


def test_matrix_lift_grid_mode_equals_grid_sample_sum(tmp_path: Path, small_distorted_multi: RigConfig, features_multi: torch.Tensor) -> None:
    """grid mode, topk 0, sum: sum over cameras and heights of F.grid_sample on grid/norm."""
    store = build_grid_store(small_distorted_multi, tmp_path)
    add_matrix_group(store, small_distorted_multi, MatrixOptions(mode="grid", topk=0, align=16))
    out = MatrixLift(store, form="ell")(features_multi)
    ref = torch_grid_sample_reference(store, features_multi).sum(dim=(1, 3))
    assert torch.max(torch.abs(out.double() - ref)).item() < 5e-6


def test_matrix_lift_buffers_and_errors(tmp_path: Path, small: RigConfig) -> None:
    store = build_grid_store(small, tmp_path)
    with pytest.raises(StoreError, match=r"no group matrix/.*bevcompile matrix"):
        MatrixLift(store)
    add_matrix_group(store, small, MatrixOptions(mode="frustum", topk=6, align=8))
    module = MatrixLift(store, form="ell")
    state = module.state_dict()
    loaded = load(store)
    assert set(state) == {"ell_index", "ell_weight", "feat_index"}
    assert np.array_equal(state["ell_index"].numpy(), loaded["matrix"]["ell_index"])
    layout = matrix_layout(loaded)
    assert (layout.mode, layout.rows_pad, layout.k_pad) == ("frustum", 24 * 24, 8)
    # feat_index is the (cam, v, u) column of each (cam, d, v, u) entry
    w_f, h_f = small.feature_size
    col = state["ell_index"].numpy().astype(np.int64)
    cam, rem = np.divmod(col, small.depth.n_bins * h_f * w_f)
    assert np.array_equal(state["feat_index"].numpy(), cam * h_f * w_f + rem % (h_f * w_f))
    with pytest.raises(StoreError, match="tile-rows"):
        MatrixLift(store, form="tiles")
    with pytest.raises(UsageError, match="frustum mode needs depth"):
        module(torch.zeros(1, small.n_cam, 2, h_f, w_f))
    with pytest.raises(UsageError, match="form"):
        MatrixLift(store, form="dense")


# --------------------------------------------------------------------------------------
# quantised weights: GridGather(weights="lut"), MatrixLift(weights="int8")
# --------------------------------------------------------------------------------------


def numpy_lut_gather(store: Path, features: np.ndarray) -> np.ndarray:
    """The LUT gather in numpy, from the stored codes alone: ``(N, C, n_h, ny, nx)`` float64,
    summed over cameras. Corner ``(v_j, u_i)`` weighs ``lut[cv_j] * lut[cu_i]`` with the codes
    ``(cu0, cu1, cv0, cv1)``; rows back to cell order with ``perm_inverse``."""
    loaded = load(store)
    group = loaded["gather"]
    codes = np.asarray(group["weight_u8"]).reshape(-1, 4).astype(np.int64)
    lut = np.asarray(group["lut"], dtype=np.float64)
    wu0, wu1, wv0, wv1 = (lut[codes[:, k]] for k in range(4))
    weight = np.stack([wv0 * wu0, wv0 * wu1, wv1 * wu0, wv1 * wu1], axis=1)  # (v0,u0) (v0,u1) (v1,u0) (v1,u1)
    index = np.asarray(group["index"]).reshape(-1, 4).astype(np.int64)
    n, n_cam, c = features.shape[:3]
    n_h, ny, nx = loaded.bev_shape
    stacked = np.asarray(features, dtype=np.float64).transpose(0, 2, 1, 3, 4).reshape(n, c, -1)
    per_row = (stacked[:, :, index] * weight).sum(axis=-1)  # (N, C, rows)
    rows = np.asarray(group["perm_inverse"]) if "perm_inverse" in group else np.arange(n_cam * n_h * ny * nx)
    return per_row[:, :, rows].reshape(n, c, n_cam, n_h, ny, nx).sum(axis=2)


def dequantised_int8_lift(store: Path, form: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """``W_dequant @ X`` in float64 with a dense ``W_dequant`` built from the stored int8 values:
    ``float32(q) * scale`` per row (ELL slots or tile blocks); ``(N, C, ny, nx)``, cells without a row 0."""
    loaded = load(store)
    group = loaded["matrix"]
    layout = matrix_layout(loaded)
    if form == "ell":
        q, scale = np.asarray(group["ell_weight_int8"]), np.asarray(group["row_scale"])
        dense = np.zeros((q.shape[0], layout.n_cols))
        rows = np.repeat(np.arange(q.shape[0]), q.shape[1])
        np.add.at(dense, (rows, np.asarray(group["ell_index"]).ravel()), (q.astype(np.float32) * scale[:, None]).ravel())
    else:
        r, o = layout.tile_rows, np.asarray(group["tile_col_offsets"])
        assert r is not None
        q, scale, cols = np.asarray(group["tile_weight_int8"]), np.asarray(group["tile_row_scale"]), np.asarray(group["tile_cols"])
        dense = np.zeros(((o.size - 1) * r, layout.n_cols))
        for t in range(o.size - 1):
            block = q[r * o[t] : r * o[t + 1]].reshape(r, o[t + 1] - o[t]).astype(np.float32) * scale[t * r : (t + 1) * r, None]
            np.add.at(dense, (np.repeat(np.arange(t * r, (t + 1) * r), block.shape[1]), np.tile(cols[o[t] : o[t + 1]], r)), block.ravel())
    features = inputs["features"].astype(np.float64)
    n, _n_cam, c = features.shape[:3]
    _, ny, nx = loaded.bev_shape
    out = np.zeros((n, c, ny * nx))
    for b in range(n):
        if layout.mode == "frustum":
            x = inputs["depth"][b].astype(np.float64)[:, :, None] * features[b][:, None]  # (n_cam, D, C, H, W)
            x = np.moveaxis(x, 2, -1).reshape(-1, c)
        else:
            x = np.moveaxis(features[b], 1, -1).reshape(-1, c)
        out[b][:, layout.row_cells] = (dense[: layout.n_rows] @ x).T
    return out.reshape(n, c, ny, nx)


def psnr_db(got: np.ndarray, ref: np.ndarray) -> float:
    """PSNR with peak = the reference's value range."""
    peak = float(ref.max() - ref.min())
    mse = float(np.mean((np.asarray(got, np.float64) - ref) ** 2))
    return float(10 * np.log10(peak**2 / mse))


@pytest.mark.parametrize(("align", "order"), [(1, "row"), (16, "cache")])
def test_grid_gather_lut_equals_numpy_reference_and_stays_within_the_lut_bound(
    tmp_path: Path, small_distorted_multi: RigConfig, features_multi: torch.Tensor, align: int, order: str
) -> None:
    """weights="lut": equal to the numpy decode of weight_u8/lut (1e-5); per camera within the
    recorded lut_max_sample_error_unit_features of torch grid_sample on unit-range features."""
    store = build_grid_store(small_distorted_multi, tmp_path, npu=True, align=align, order=order)
    module = GridGather(store, weights="lut")
    out = module(features_multi)
    assert out.shape == (2, 5, 3, 40, 40)
    assert np.max(np.abs(out.double().numpy() - numpy_lut_gather(store, features_multi.numpy()))) <= 1e-5
    # the quantisation is visible (the test would not notice float weights otherwise)
    assert torch.max(torch.abs(out - GridGather(store)(features_multi))).item() > 1e-4
    bound = float(load(store)["gather"].attrs["lut_max_sample_error_unit_features"])
    assert 0 < bound < 0.01
    assert features_multi.min().item() >= 0.0 and features_multi.max().item() <= 1.0
    ref = torch_grid_sample_reference(store, features_multi)  # (N, n_cam, C, n_h, ny, nx)
    worst = 0.0
    for cam in range(features_multi.shape[1]):
        only = torch.zeros_like(features_multi)
        only[:, cam] = features_multi[:, cam]
        worst = max(worst, torch.max(torch.abs(module(only).double() - ref[:, cam])).item())
    assert 1e-4 < worst <= bound + 2e-6
    # reduce="mean" divides the same LUT sum by the number of valid cameras
    count = np.asarray(load(store)["grid"]["valid"]).sum(axis=0)
    mean = GridGather(store, weights="lut", reduce="mean")(features_multi).double().numpy()
    assert np.max(np.abs(mean * np.maximum(count, 1) - out.double().numpy())) <= 1e-5


def test_grid_gather_lut_buffers_and_errors(tmp_path: Path, small: RigConfig, multi_store: Path) -> None:
    store = build_grid_store(small, tmp_path, npu=True)
    module = GridGather(store, weights="lut")
    state = module.state_dict()
    assert set(state) == {"index", "weight_u8", "lut"}
    gather = load(store)["gather"]
    assert state["weight_u8"].dtype == torch.uint8 and state["lut"].dtype == torch.float32
    assert np.array_equal(state["weight_u8"].numpy(), gather["weight_u8"])
    assert np.array_equal(state["lut"].numpy(), gather["lut"])
    assert "weights=lut" in repr(module)
    with pytest.raises(UsageError, match=r"weights must be one of float32, lut, got 'int8'"):
        GridGather(store, weights="int8")
    with pytest.raises(UsageError, match=r"source='grid' has no LUT codes"):
        GridGather(store, weights="lut", source="grid")
    with pytest.raises(StoreError, match=r"weights='lut' needs the gather/ group.*`bevcompile grid`"):
        GridGather(multi_store, weights="lut")


INT8_CASES = {
    "frustum": MatrixOptions(mode="frustum", topk=8, align=8, tile_rows=64, compact_rows=True, quantize="int8"),
    "grid": MatrixOptions(mode="grid", topk=4, align=4, tile_rows=100, normalize="mean", quantize="int8"),
}


@pytest.fixture(scope="module", params=sorted(INT8_CASES))
def int8_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, small_distorted_multi: RigConfig) -> Path:
    store = build_grid_store(small_distorted_multi, tmp_path_factory.mktemp("int8"))
    add_matrix_group(store, small_distorted_multi, INT8_CASES[request.param])
    return store


@pytest.mark.parametrize("form", ["ell", "tiles"])
def test_matrix_lift_int8_equals_dequantised_product(int8_store: Path, form: str) -> None:
    """weights="int8": W_dequant @ X to 1e-5 (row scale applied after the reduction), and
    >= 40 dB PSNR against the float matrix (W @ X from the float32 COO)."""
    loaded = load(int8_store)
    mode = matrix_layout(loaded).mode
    inputs = make_inputs(loaded, channels=5, batch=2, seed=3, with_depth=mode == "frustum")
    module = MatrixLift(int8_store, form=form, weights="int8")
    out = module(*(torch.from_numpy(v) for v in inputs.values())).numpy()
    ref = dequantised_int8_lift(int8_store, form, inputs)
    assert out.shape == (2, 5, 40, 40)
    assert np.abs(ref).max() > 0.1
    assert np.max(np.abs(out - ref)) <= 1e-5
    float_ref = reference_matrix_lift(loaded, inputs["features"], inputs.get("depth"))
    assert np.max(np.abs(out - float_ref)) > 1e-5  # the int8 error is there ...
    assert psnr_db(out, float_ref) >= 40.0  # ... and small


def test_matrix_lift_int8_buffers(int8_store: Path) -> None:
    loaded = load(int8_store)
    group = loaded["matrix"]
    frustum = matrix_layout(loaded).mode == "frustum"
    ell = MatrixLift(int8_store, form="ell", weights="int8")
    state = ell.state_dict()
    assert {"ell_index", "ell_weight_int8", "row_scale"} <= set(state) and "ell_weight" not in state
    assert ("feat_index" in state) == frustum
    assert state["ell_weight_int8"].dtype == torch.int8 and state["row_scale"].dtype == torch.float32
    assert np.array_equal(state["ell_weight_int8"].numpy(), group["ell_weight_int8"])
    assert np.array_equal(state["row_scale"].numpy(), group["row_scale"])
    tiles = MatrixLift(int8_store, form="tiles", weights="int8")
    state = tiles.state_dict()
    assert "tile_weight" not in state and "tile_weight_int8" not in state  # persistent as its per-tile views
    blocks = [state[f"tile{t}_block"] for t in range(len(tiles.tiles))]
    assert all(b.dtype == torch.int8 for b in blocks)
    assert np.array_equal(np.concatenate([b.numpy().ravel() for b in blocks]), group["tile_weight_int8"])
    assert np.array_equal(state["tile_row_scale"].numpy(), group["tile_row_scale"])
    assert "weights=int8" in repr(tiles)


def test_matrix_lift_int8_errors(tmp_path: Path, small: RigConfig) -> None:
    plain = build_grid_store(small, tmp_path / "plain")
    add_matrix_group(plain, small, MatrixOptions(mode="grid", topk=4, align=4, tile_rows=64))
    with pytest.raises(StoreError, match=r"weights='int8' needs matrix/ell_weight_int8.*`bevcompile matrix --quantize int8`"):
        MatrixLift(plain, weights="int8")
    with pytest.raises(UsageError, match=r"weights must be one of float32, int8, fp16, mixed, got 'lut'"):
        MatrixLift(plain, weights="lut")
    no_tiles = build_grid_store(small, tmp_path / "no_tiles")
    add_matrix_group(no_tiles, small, MatrixOptions(mode="grid", topk=4, align=4, quantize="int8"))
    assert MatrixLift(no_tiles, weights="int8").weights == "int8"
    with pytest.raises(StoreError, match="tile-rows"):
        MatrixLift(no_tiles, form="tiles", weights="int8")


# --------------------------------------------------------------------------------------
# reloading weights, dtypes and input shapes
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_tiles_load_state_dict_with_assign_uses_the_loaded_tables(tmp_path: Path, small_distorted_multi: RigConfig, weights: str) -> None:
    """``load_state_dict(sd, assign=True)`` (how a module built on the ``meta`` device is filled)
    replaces the persistent tensors; the forward must read them, not the per-tile views of the
    old ones — also after a later ``.to(dtype)`` (int8: the flat buffer follows the loaded blocks)."""
    options = MatrixOptions(mode="frustum", topk=8, align=4, tile_rows=48, quantize="int8" if weights == "int8" else None)
    store = build_grid_store(small_distorted_multi, tmp_path)
    add_matrix_group(store, small_distorted_multi, options)
    inputs = [torch.from_numpy(v) for v in make_inputs(load(store), channels=3, batch=2, seed=4, with_depth=True).values()]
    source = MatrixLift(store, form="tiles", weights=weights)
    expected = source(*inputs)
    assert expected.abs().max() > 0.1
    state = {k: v.clone() for k, v in source.state_dict().items()}
    stale = MatrixLift(store, form="tiles", weights=weights)
    with torch.no_grad():
        for tensor in stale.state_dict().values():
            tensor.zero_()  # every table (and view) of the target module is wrong before the load
    stale.load_state_dict(state, assign=True)
    assert torch.equal(stale(*inputs), expected)
    on_meta = MatrixLift(store, form="tiles", weights=weights).to("meta")
    on_meta.load_state_dict(state, assign=True)
    assert torch.equal(on_meta(*inputs), expected)
    as_double = on_meta.double()(*(x.double() for x in inputs))
    assert torch.allclose(as_double, expected.double(), atol=1e-5)


def test_tiles_promote_float64_and_float16_inputs_like_ell(tmp_path: Path, small_distorted_multi: RigConfig) -> None:
    store = build_grid_store(small_distorted_multi, tmp_path)
    add_matrix_group(store, small_distorted_multi, MatrixOptions(mode="frustum", topk=8, align=4, tile_rows=48))
    loaded = load(store)
    inputs = make_inputs(loaded, channels=3, batch=1, seed=2, with_depth=True)
    ref = reference_matrix_lift(loaded, inputs["features"], inputs["depth"])
    ell, tiles = MatrixLift(store, form="ell"), MatrixLift(store, form="tiles")
    for dtype, tol in ((torch.float64, 2e-6), (torch.float16, 2e-2)):
        args = [torch.from_numpy(v).to(dtype) for v in inputs.values()]
        got_ell, got_tiles = ell(*args), tiles(*args)
        assert got_tiles.dtype == got_ell.dtype == torch.promote_types(dtype, torch.float32)
        assert np.max(np.abs(got_tiles.double().numpy() - ref)) < tol
        assert torch.allclose(got_tiles.double(), got_ell.double(), atol=tol)


def test_wrong_rank_inputs_and_depth_in_grid_mode_are_usage_errors(tmp_path: Path, small: RigConfig, multi_store: Path) -> None:
    gather = GridGather(multi_store)
    w_f, h_f = gather.feature_size
    with pytest.raises(UsageError, match=rf"features \(4, 5, {h_f}, {w_f}\) do not fit the store: expected \(N, 4, C, {h_f}, {w_f}\)"):
        gather(torch.zeros(gather.n_cam, 5, h_f, w_f))
    store = build_grid_store(small, tmp_path)
    add_matrix_group(store, small, MatrixOptions(mode="grid", topk=4, align=4, tile_rows=64))
    w_f, h_f = small.feature_size
    features = torch.rand(1, small.n_cam, 2, h_f, w_f)
    for form in ("ell", "tiles"):
        lift = MatrixLift(store, form=form)
        with pytest.raises(UsageError, match=r"expected \(N, "):
            lift(features[0])
        with pytest.raises(UsageError, match=r"grid mode .* takes no depth"):
            lift(features, torch.rand(1, small.n_cam, small.depth.n_bins, h_f, w_f))
        assert lift(features).shape == (1, 2, small.bev.ny, small.bev.nx)


# --------------------------------------------------------------------------------------
# LearnableLift: trainable ELL values on the fixed topology
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["grid", "frustum"])
def learnable_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, small: RigConfig) -> Path:
    return run_matrix(small, tmp_path_factory.mktemp(f"learn-{request.param}"), MatrixOptions(mode=request.param, topk=8, align=16)).store


def _inputs(lift: MatrixLift, rig: RigConfig, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    w_f, h_f = rig.feature_size
    x = torch.rand(2, rig.n_cam, 3, h_f, w_f, generator=g)
    if lift.mode == "frustum":
        return x, torch.rand(2, rig.n_cam, rig.depth.n_bins, h_f, w_f, generator=g).softmax(2)
    return (x,)


def test_learnable_lift_starts_as_the_store_and_its_mask_is_the_coo(learnable_store: Path, small: RigConfig) -> None:
    lift = LearnableLift(learnable_store)
    fixed = MatrixLift(learnable_store)
    args = _inputs(lift, small)
    assert isinstance(lift.ell_weight, torch.nn.Parameter) and [n for n, _ in lift.named_parameters()] == ["ell_weight"]
    assert torch.equal(lift(*args), fixed(*args))
    coo_row = np.asarray(load(learnable_store)["matrix"]["coo_row"])
    assert int(lift.ell_mask.sum()) == coo_row.size
    assert np.array_equal(lift.ell_mask.sum(dim=1).numpy()[: 576], np.bincount(coo_row, minlength=576))
    assert set(lift.state_dict()) == set(fixed.state_dict())  # MatrixLift's keys: a checkpoint loads into either


@pytest.mark.parametrize("optimiser", ["sgd", "adam", "adamw"])
def test_learnable_lift_gradients_reach_only_real_slots_and_padding_stays_zero(learnable_store: Path, small: RigConfig, optimiser: str) -> None:
    lift = LearnableLift(learnable_store)
    params = list(lift.parameters())
    opt = {
        "sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
        "adam": lambda: torch.optim.Adam(params, lr=0.05),
        "adamw": lambda: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
    }[optimiser]()
    args = _inputs(lift, small)
    for step in range(3):
        out = lift(*args)
        # a NaN upstream gradient must not reach the padding either
        loss = (out * out).mean() - out.mean() if step else out.sum() * float("nan")
        opt.zero_grad()
        loss.backward()
        grad = lift.ell_weight.grad
        assert grad is not None and torch.all(grad[~lift.ell_mask] == 0)
        if step:
            assert torch.count_nonzero(grad[lift.ell_mask]) > 0.9 * int(lift.ell_mask.sum())
            opt.step()
    assert torch.all(lift.ell_weight[~lift.ell_mask] == 0)
    assert np.all(lift.learned_values()[~lift.ell_mask.numpy()] == 0)
    changed = lift.learned_values() != np.asarray(load(learnable_store)["matrix"]["ell_weight"])
    assert changed.sum() > 0.9 * int(lift.ell_mask.sum())


def test_learnable_lift_nonnegative_is_projected_and_entries_can_come_back(learnable_store: Path, small: RigConfig) -> None:
    lift = LearnableLift(learnable_store, constraint="nonnegative")
    args = _inputs(lift, small)
    opt = torch.optim.SGD(lift.parameters(), lr=10.0)
    lift(*args).sum().backward()  # d(sum)/dw > 0: a descent step of lr 10 drives the values far below 0
    opt.step()
    assert (lift.ell_weight < 0).any()
    out = lift(*args)  # the forward projects first
    assert torch.all(lift.ell_weight >= 0) and torch.all(out == 0)
    opt.zero_grad()
    (-out.sum()).backward()  # gradient at w = 0 passes (max(w, 0) is differentiable from the right)
    assert torch.all(lift.ell_weight.grad[lift.ell_mask] <= 0) and (lift.ell_weight.grad[lift.ell_mask] < 0).any()
    opt.step()
    assert (lift.learned_values() > 0).any() and np.all(lift.learned_values() >= 0)
    fixed = MatrixLift(learnable_store)
    fixed.load_state_dict(lift.state_dict())
    assert torch.equal(fixed(*args), lift(*args))


def test_learnable_lift_refuses_other_forms_and_constraints(learnable_store: Path) -> None:
    with pytest.raises(UsageError, match="LearnableLift trains the ELL values"):
        LearnableLift(learnable_store, form="tiles")
    with pytest.raises(UsageError, match="constraint must be one of none, nonnegative"):
        LearnableLift(learnable_store, constraint="positive")


# --------------------------------------------------------------------------------------
# GridGather on a bev.region store
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("align", "order", "weights", "reduce"), [(1, "row", "float32", "sum"), (8, "cache", "float32", "mean"), (1, "row", "lut", "sum")])
def test_region_grid_gather_expands_with_one_gather_and_samples_super_cells_at_their_centre(
    tmp_path: Path, align: int, order: str, weights: str, reduce: str
) -> None:
    """On a region store GridGather's (N, C, 1, ny, nx): fine kept cells equal the full-grid module
    exactly, cells outside the region are 0, every fine cell of a super-cell reads one value, and
    (float32 weights) that value is F.grid_sample at the super-cell's centre, projected here with the
    rig geometry (x_min + (ix + size/2) dx, ...) and normalised with align_corners=False's
    (2 u + 1) / W - 1. rows='compact' gives the kept cells, which expand reproduces."""
    from bevcompile.grid.ipm import inside_feature_map
    from bevcompile.rig.geometry import project_bev_to_feature

    full, region = region_grid_stores(tmp_path, npu=True, align=align, order=order)
    features = torch.rand(2, 4, 3, 8, 12, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = GridGather(region, weights=weights, reduce=reduce)(features)
        want = GridGather(full, weights=weights, reduce=reduce)(features)
        compact = GridGather(region, weights=weights, reduce=reduce, rows="compact")(features)
    loaded = load(region)
    rig = loaded.rig
    cells = np.asarray(loaded["grid"]["cells"])
    expand = np.asarray(loaded["grid"]["expand"]).astype(np.int64)
    n_kept = cells.shape[0]
    assert got.shape == want.shape == (2, 3, 1, 24, 24) and compact.shape == (2, 3, 1, n_kept)
    flat_got = got.reshape(2, 3, -1).numpy()
    flat_want = want.reshape(2, 3, -1).numpy()
    fine = cells[:, 2] == 1
    fine_cells = cells[fine, 0] * rig.bev.nx + cells[fine, 1]
    assert np.array_equal(flat_got[:, :, fine_cells], flat_want[:, :, fine_cells])
    assert not np.any(flat_got[:, :, expand == n_kept])
    dense = np.concatenate([compact.numpy()[:, :, 0], np.zeros((2, 3, 1), np.float32)], axis=2)[:, :, expand]
    assert np.array_equal(dense, flat_got)
    if weights != "float32":
        return
    coarse = np.flatnonzero(~fine)
    assert coarse.size
    x = rig.bev.x.min + (cells[coarse, 1] + cells[coarse, 2] / 2) * rig.bev.x.step
    y = rig.bev.y.min + (cells[coarse, 0] + cells[coarse, 2] / 2) * rig.bev.y.step
    points = np.stack([x, y, np.zeros_like(x)], axis=1)
    w_f, h_f = rig.feature_size
    ref = torch.zeros(2, 3, coarse.size, dtype=torch.float64)
    count = np.zeros(coarse.size)
    for cam_index, camera in enumerate(rig.cameras):
        uv, ok = project_bev_to_feature(rig, camera, points)
        ok &= inside_feature_map(uv, rig.feature_size)
        norm = np.stack([(2 * uv[:, 0] + 1) / w_f - 1, (2 * uv[:, 1] + 1) / h_f - 1], axis=1)
        grid = torch.from_numpy(np.where(ok[:, None], norm, -5.0)).reshape(1, 1, -1, 2).expand(2, -1, -1, -1)
        ref += F.grid_sample(features[:, cam_index].double(), grid, mode="bilinear", padding_mode="zeros", align_corners=False)[:, :, 0]
        count += ok
    if reduce == "mean":
        ref = torch.where(torch.from_numpy(count > 0), ref / torch.from_numpy(np.maximum(count, 1)), 0.0)
    assert float((compact[:, :, 0, coarse].double() - ref).abs().max()) <= 1e-5


def test_region_grid_gather_rows_option_is_checked(tmp_path: Path) -> None:
    full, _region = region_grid_stores(tmp_path, npu=True)
    with pytest.raises(UsageError, match=r"rows='compact' needs a store built with a bev\.region"):
        GridGather(full, rows="compact")
    with pytest.raises(UsageError, match="rows must be one of dense, compact, got 'sparse'"):
        GridGather(full, rows="sparse")
