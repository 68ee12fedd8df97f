"""bevcompile.torch: ``MatrixLift(weights="fp16"|"mixed")``, ``guard=True`` and ``ClassLift``,
each against an independent reference: the stored COO / decoded weights applied with scipy in
float64, ``torch.nn.functional.one_hot`` + ``MatrixLift`` (and a dense numpy one-hot product) for
the class lift, the unguarded module on clean inputs for the guard; and their legacy ONNX export
(no OneHot / ScatterND / GridSample, static shapes, onnxruntime = torch)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from bevcompile.deploy.onnx_graph import scan_graph
from bevcompile.errors import StoreError, UsageError
from bevcompile.matrix.build import MatrixOptions
from bevcompile.matrix.precision import class_lift_reference, decode_fp16, mixed_ell_values
from bevcompile.rig.config import RigConfig
from bevcompile.store.loader import load, matrix_layout
from bevcompile.torch import ClassLift, GridGather, MatrixLift

from ..matrix.test_region import rigs as region_rigs
from ..rigs import small_rig
from .test_torch import add_matrix_group, build_grid_store

N_CLASSES = 4


def _inputs(rig: RigConfig, n: int = 2, c: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w_f, h_f = rig.feature_size
    g = torch.Generator().manual_seed(seed)
    features = torch.rand(n, rig.n_cam, c, h_f, w_f, generator=g)
    depth = torch.softmax(torch.randn(n, rig.n_cam, rig.depth.n_bins, h_f, w_f, generator=g), dim=2)
    return features, depth


def _decoded_ell(store: Path, weights: str) -> np.ndarray:
    g = load(store)["matrix"]
    if weights == "fp16":
        return decode_fp16(g["ell_weight_fp16"])
    return mixed_ell_values(g["ell_weight_int8"], g["row_scale"], g["fp16_rows"], g["fp16_row_weight"])


def _reference(store: Path, values: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``W @ X`` in float64 with ``values`` in the ELL layout, scipy CSR, mapped to the dense map
    (``(N, C, ny, nx)``; region: through ``matrix/expand``; compact rows: through ``row_ids``).
    ``x``: ``(N, n_cols, C)`` float64 (the lifted columns)."""
    loaded = load(store)
    layout = matrix_layout(loaded)
    index = np.asarray(loaded["matrix"]["ell_index"], dtype=np.int64)
    rows = np.repeat(np.arange(index.shape[0]), index.shape[1])
    w = sp.csr_matrix((values.astype(np.float64).ravel(), (rows, index.ravel())), shape=(index.shape[0], layout.n_cols))
    out = np.stack([w @ x[b] for b in range(x.shape[0])])[:, : layout.n_rows]  # (N, n_rows, C)
    n_cells = layout.n_cells
    if layout.expand is not None:
        cells = out[:, layout.expand]
    else:
        cells = np.zeros((x.shape[0], n_cells, x.shape[2]))
        cells[:, layout.row_cells] = out
    _, ny, nx = loaded.bev_shape
    return cells.transpose(0, 2, 1).reshape(x.shape[0], x.shape[2], ny, nx)


def _lifted(store: Path, features: torch.Tensor, depth: torch.Tensor | None) -> np.ndarray:
    """``X`` ``(N, n_cols, C)`` float64: features (grid / ray) or depth x features (frustum)."""
    f = features.double().numpy()
    n, n_cam, c, h, w = f.shape
    pix = f.transpose(0, 1, 3, 4, 2).reshape(n, n_cam, h * w, c)
    if depth is None:
        return pix.reshape(n, n_cam * h * w, c)
    d = depth.double().numpy().reshape(n, n_cam, -1, h * w)
    return (d[..., None] * pix[:, :, None]).reshape(n, -1, c)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small rig stores: frustum mixed (ELL + tiles), grid fp16 compact rows, region ray mixed."""
    rig = small_rig()
    out: dict[str, Path] = {}
    for name, options, r in (
        ("frustum_mixed", MatrixOptions(mode="frustum", topk=8, align=8, tile_rows=32, quantize="mixed", fp16_rows="beyond:10"), rig),
        ("grid_fp16", MatrixOptions(mode="grid", topk=4, align=4, tile_rows=50, quantize="fp16", compact_rows=True), rig),
        ("region_mixed", MatrixOptions(mode="ray", topk=6, align=8, tile_rows=16, quantize="mixed", fp16_rows="fraction:0.4"), region_rigs()[1]),
    ):
        store = build_grid_store(r, tmp_path_factory.mktemp(name), npu=True)
        add_matrix_group(store, r, options)
        out[name] = store
    return out


@pytest.mark.parametrize("name", ["frustum_mixed", "grid_fp16", "region_mixed"])
@pytest.mark.parametrize("form", ["ell", "tiles"])
def test_fp16_and_mixed_lifts_equal_the_float64_product_of_their_decoded_weights(stores: dict[str, Path], name: str, form: str) -> None:
    store = stores[name]
    loaded = load(store)
    weights = "fp16" if "fp16" in name else "mixed"
    module = MatrixLift(store, form=form, weights=weights)
    features, depth = _inputs(loaded.rig)
    frustum = module.mode == "frustum"
    out = module(features, depth) if frustum else module(features)
    ref = _reference(store, _decoded_ell(store, weights), _lifted(store, features, depth if frustum else None))
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert np.max(np.abs(out.double().numpy() - ref)) <= 2e-6 * max(1.0, np.abs(ref).max())
    # and it is not the float form: the reduced weights make a measurable difference
    floats = MatrixLift(store, form=form)(features, depth) if frustum else MatrixLift(store, form=form)(features)
    assert 0 < float((out - floats).abs().max()) < 1e-2 * float(floats.abs().max())
    if weights == "mixed":
        assert module.n_fp16_rows == int(loaded["matrix"]["fp16_rows"].size) > 0
        int8 = MatrixLift(store, form=form, weights="int8")
        assert not torch.equal(int8(features, depth) if frustum else int8(features), out)


def test_buffers_of_the_reduced_forms_keep_their_stored_dtypes(stores: dict[str, Path]) -> None:
    ell = MatrixLift(stores["frustum_mixed"], weights="mixed").state_dict()
    assert ell["ell_weight_int8"].dtype == torch.int8 and ell["fp16_row_weight"].dtype == torch.float16
    assert "ell_weight" not in ell and "ell_index" not in ell  # two row groups: int8_index / fp16_index
    g = load(stores["frustum_mixed"])["matrix"]
    n16 = int(g["fp16_rows"].size)
    assert ell["fp16_index"].shape == (n16, g["ell_index"].shape[1]) and ell["int8_index"].shape[0] + n16 == g["ell_index"].shape[0]
    tiles = MatrixLift(stores["grid_fp16"], form="tiles", weights="fp16")
    state = tiles.state_dict()
    blocks = [state[f"tile{t}_block"] for t in range(len(tiles.tiles))]
    assert all(b.dtype == torch.float16 for b in blocks) and "tile_weight_fp16" not in state
    assert np.array_equal(np.concatenate([b.numpy().ravel() for b in blocks]), load(stores["grid_fp16"])["matrix"]["tile_weight_fp16"])
    mixed_tiles = MatrixLift(stores["frustum_mixed"], form="tiles", weights="mixed").state_dict()
    assert any(k.endswith("_block16") and v.dtype == torch.float16 for k, v in mixed_tiles.items())


def test_fp16_tiles_load_state_dict_with_assign_uses_the_loaded_blocks(stores: dict[str, Path]) -> None:
    store = stores["grid_fp16"]
    module = MatrixLift(store, form="tiles", weights="fp16")
    features, _ = _inputs(load(store).rig)
    want = module(features)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    fresh = MatrixLift(store, form="tiles", weights="fp16")
    for key in state:
        if key.endswith("_block"):
            state[key] = state[key] * 0  # loaded zeros must reach the forward
    fresh.load_state_dict(state, assign=True)
    assert float(fresh(features).abs().max()) == 0.0
    fresh.load_state_dict(module.state_dict(), assign=True)
    assert torch.equal(fresh(features), want)


def test_reduced_weights_missing_from_the_store_are_one_line(stores: dict[str, Path]) -> None:
    with pytest.raises(StoreError, match=r"weights='fp16' needs matrix/ell_weight_fp16; rebuild the matrix with `bevcompile matrix --quantize fp16`"):
        MatrixLift(stores["frustum_mixed"], weights="fp16")
    with pytest.raises(StoreError, match=r"weights='mixed' with form='tiles' needs matrix/tile_weight_int8 \+ tile_row_scale \+ fp16_rows"):
        MatrixLift(stores["grid_fp16"], form="tiles", weights="mixed")
    with pytest.raises(UsageError, match="guard must be True or False"):
        MatrixLift(stores["grid_fp16"], guard="yes")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# guard
# --------------------------------------------------------------------------------------


def _fed_by(store: Path, cam: int) -> torch.Tensor:
    """bool ``(ny, nx)``: the cells whose row has an entry in camera ``cam``'s columns."""
    loaded = load(store)
    layout = matrix_layout(loaded)
    g = loaded["matrix"]
    row, col = np.asarray(g["coo_row"], np.int64), np.asarray(g["coo_col"], np.int64)
    rows = np.zeros(layout.n_rows, dtype=bool)
    rows[row[col // (layout.n_cols // loaded.rig.n_cam) == cam]] = True
    cell = rows[layout.expand] if layout.expand is not None else np.isin(np.arange(layout.n_cells), layout.row_cells[rows])
    _, ny, nx = loaded.bev_shape
    return torch.from_numpy(cell.reshape(ny, nx))


def _hazard_pixel(store: Path, form: str) -> tuple[int, int] | None:
    """A pixel ``(v, u)`` of camera 0 that the UNGUARDED lift reads with weight 0 for a cell camera 0
    does not feed: ELL — column 0 (an empty row's padding index) when the grid has an empty cell;
    tiles — a camera-0 column of a tile holding a row camera 0 does not feed. None if there is none."""
    loaded = load(store)
    layout = matrix_layout(loaded)
    g = loaded["matrix"]
    w_f, h_f = loaded.rig.feature_size
    plane = w_f * h_f
    per_cam = layout.n_cols // loaded.rig.n_cam
    fed = _fed_by(store, 0).numpy().ravel()
    row_fed = np.zeros(layout.n_rows, dtype=bool)  # rows that read camera 0 (by cell)
    row, col = np.asarray(g["coo_row"], np.int64), np.asarray(g["coo_col"], np.int64)
    row_fed[row[col < per_cam]] = True
    empty = np.bincount(row, minlength=layout.n_rows) == 0
    if form == "ell":
        mapped = np.unique(layout.expand) if layout.expand is not None else np.arange(layout.n_rows)  # the rows the map reads
        return (0, 0) if empty[mapped].any() and not fed.all() else None
    r = int(layout.tile_rows or 1)
    offsets, cols = np.asarray(g["tile_col_offsets"]), np.asarray(g["tile_cols"], np.int64)
    for t in range(offsets.size - 1):
        rows = np.arange(t * r, min((t + 1) * r, layout.n_rows))
        if rows.size and (~row_fed[rows] & ~empty[rows]).any():
            cam0 = cols[offsets[t] : offsets[t + 1]]
            cam0 = cam0[cam0 < per_cam]
            if cam0.size:
                pix = int(cam0[0] % plane)
                return pix // w_f, pix % w_f
    return None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 3e38])
@pytest.mark.parametrize(
    ("name", "form", "weights", "hazard"),
    [("frustum_mixed", "ell", "float32", True), ("frustum_mixed", "tiles", "mixed", True), ("grid_fp16", "tiles", "fp16", True), ("grid_fp16", "ell", "float32", False)],
)
def test_guarded_lift_confines_a_bad_camera_to_the_cells_it_feeds(stores: dict[str, Path], name: str, form: str, weights: str, hazard: bool, bad: float) -> None:
    """One pixel of camera 0 set to NaN / +-inf / 3e38 (and its depth to NaN in frustum mode):
    the guarded module's output on every cell camera 0 does not feed equals the clean output
    (torch.equal), and every cell is finite for a non-finite value. Unguarded, a NaN / inf also
    lands in cells camera 0 does not feed (0 * NaN in an ELL padding slot or a tile block) —
    where the store has such a slot (``hazard``; a compact-rows ELL has no empty row to read it)."""
    store = stores[name]
    features, depth = _inputs(load(store).rig, n=1)
    module = MatrixLift(store, form=form, weights=weights, guard=True)
    frustum = module.mode == "frustum"
    plain = MatrixLift(store, form=form, weights=weights)
    clean = module(features, depth) if frustum else module(features)
    assert torch.equal(clean, plain(features, depth) if frustum else plain(features))
    pixel = _hazard_pixel(store, form)
    assert (pixel is not None) == hazard
    v, u = pixel or (0, 0)
    dirty = features.clone()
    dirty[0, 0, :, v, u] = bad
    dirty_depth = depth.clone()
    if frustum and bad != bad:
        dirty_depth[0, 0, :, v, u] = bad
    out = module(dirty, dirty_depth) if frustum else module(dirty)
    others = ~_fed_by(store, 0)
    assert others.any()
    assert torch.equal(out[..., others], clean[..., others])
    if bad != 3e38:
        assert torch.isfinite(out).all()
        if hazard:  # the leak the guard removes
            leaked = plain(dirty, dirty_depth) if frustum else plain(dirty)
            assert not torch.isfinite(leaked[..., others]).all()


def test_guarded_grid_gather_confines_a_nan_camera(tmp_path: Path) -> None:
    rig = small_rig()
    store = build_grid_store(rig, tmp_path, npu=True)
    features, _ = _inputs(rig, n=1)
    for weights in ("float32", "lut"):
        guarded = GridGather(store, weights=weights, guard=True, collapse_heights=True)
        clean = guarded(features)
        dirty = features.clone()
        dirty[0, 1] = float("nan")  # the whole of camera 1
        out = guarded(dirty)
        seen = torch.from_numpy(np.asarray(load(store)["grid"]["valid"])[1].any(axis=0))
        assert torch.isfinite(out).all()
        assert torch.equal(out[..., ~seen], clean[..., ~seen])
        assert not torch.equal(out[..., seen], clean[..., seen])
        assert not torch.isfinite(GridGather(store, weights=weights, collapse_heights=True)(dirty)[..., ~seen]).all()


# --------------------------------------------------------------------------------------
# ClassLift
# --------------------------------------------------------------------------------------


def _labels(rig: RigConfig, n: int = 2, seed: int = 0) -> torch.Tensor:
    w_f, h_f = rig.feature_size
    labels = torch.randint(0, N_CLASSES, (n, rig.n_cam, h_f, w_f), generator=torch.Generator().manual_seed(seed))
    labels[:, :, 0, :3] = 255  # ignore labels
    labels[:, 0, 1, 0] = -1
    return labels


def _one_hot_features(labels: torch.Tensor) -> torch.Tensor:
    """``(N, n_cam, n_classes, H, W)`` float32 one-hot by torch (out-of-range labels: zero vector)."""
    valid = (labels >= 0) & (labels < N_CLASSES)
    hot = F.one_hot(torch.where(valid, labels, torch.zeros_like(labels)), N_CLASSES).float() * valid.unsqueeze(-1)
    return hot.permute(0, 1, 4, 2, 3).contiguous()


@pytest.mark.parametrize("name", ["frustum_mixed", "grid_fp16", "region_mixed"])
@pytest.mark.parametrize("form", ["ell", "tiles"])
def test_class_lift_equals_the_lift_of_one_hot_labels(stores: dict[str, Path], name: str, form: str) -> None:
    store = stores[name]
    loaded = load(store)
    labels = _labels(loaded.rig)
    _, depth = _inputs(loaded.rig)
    lift = ClassLift(store, N_CLASSES, form=form)
    frustum = lift.mode == "frustum"
    out = lift(labels, depth) if frustum else lift(labels)
    ny, nx = loaded.bev_shape[1:]
    assert out.shape == (2, N_CLASSES, ny, nx) and out.dtype == torch.float32
    hot = _one_hot_features(labels)
    plain = MatrixLift(store, form=form)
    assert torch.equal(out, plain(hot, depth) if frustum else plain(hot))  # the float form: bit for bit
    # the independent float64 reference (numpy one-hot, COO product), mapped to the dense map
    g = loaded["matrix"]
    layout = matrix_layout(loaded)
    ref_rows = class_lift_reference(
        g["coo_row"], g["coo_col"], g["coo_val"], labels.numpy(), N_CLASSES, layout.n_rows,
        n_depth=loaded.rig.depth.n_bins if frustum else None, depth=depth.numpy() if frustum else None,
    )
    cells = ref_rows[:, :, layout.expand] if layout.expand is not None else np.zeros((2, N_CLASSES, layout.n_cells))
    if layout.expand is None:
        cells[:, :, layout.row_cells] = ref_rows
    assert np.max(np.abs(out.double().numpy() - cells.reshape(out.shape))) <= 1e-5 * max(1.0, np.abs(cells).max())
    # quantised weights: the same as MatrixLift with those weights on the one-hot features
    weights = "fp16" if "fp16" in name else "mixed"
    q = ClassLift(store, N_CLASSES, form=form, weights=weights)
    qplain = MatrixLift(store, form=form, weights=weights)
    assert torch.allclose(q(labels, depth) if frustum else q(labels), qplain(hot, depth) if frustum else qplain(hot), rtol=0, atol=1e-6)


def test_class_lift_ignores_labels_outside_the_classes_and_checks_its_input(stores: dict[str, Path]) -> None:
    store = stores["grid_fp16"]
    rig = load(store).rig
    lift = ClassLift(store, N_CLASSES)
    all_ignored = torch.full((1, rig.n_cam, rig.feature_size[1], rig.feature_size[0]), 255, dtype=torch.int64)
    assert float(lift(all_ignored).abs().max()) == 0.0
    assert torch.equal(lift(all_ignored.int() * 0), lift(all_ignored * 0))  # int32 labels as int64
    with pytest.raises(UsageError, match=r"labels torch.float32 .* expected integer \(N, 4, "):
        lift(all_ignored.float())
    with pytest.raises(UsageError, match="n_classes must be an integer >= 1, got 0"):
        ClassLift(store, 0)
    assert "n_classes=4" in repr(lift)


# --------------------------------------------------------------------------------------
# ONNX (legacy exporter): static, no OneHot / ScatterND / GridSample, onnxruntime = torch
# --------------------------------------------------------------------------------------


def _export(module: torch.nn.Module, args: tuple[torch.Tensor, ...], path: Path, names: list[str]) -> tuple[Any, Any]:
    """The legacy export of ``module``: its graph scan (no forbidden op, static shapes: asserted)
    and an onnxruntime session."""
    import onnx
    import onnxruntime as ort

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=17, do_constant_folding=False, input_names=names, output_names=["bev"])
    scan = scan_graph(onnx.load(str(path)))
    assert not scan.forbidden and not scan.dynamic, (scan.forbidden, scan.dynamic)
    return scan, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(("name", "form"), [("frustum_mixed", "ell"), ("region_mixed", "tiles"), ("grid_fp16", "tiles")])
def test_class_lift_exports_without_one_hot(tmp_path: Path, stores: dict[str, Path], name: str, form: str) -> None:
    store = stores[name]
    rig = load(store).rig
    lift = ClassLift(store, N_CLASSES, form=form)
    labels = _labels(rig, n=1)
    _, depth = _inputs(rig, n=1)
    frustum = lift.mode == "frustum"
    args = (labels, depth) if frustum else (labels,)
    scan, session = _export(lift, args, tmp_path / "class.onnx", ["labels", "depth"][: len(args)])
    assert "OneHot" not in scan.op_histogram and scan.op_histogram.get("Equal", 0) >= 1
    assert set(scan.unexpected) <= {"Equal"}, scan.unexpected
    feeds = {"labels": labels.numpy()} | ({"depth": depth.numpy()} if frustum else {})
    got = session.run(None, feeds)[0]
    assert np.max(np.abs(got - lift(*args).numpy())) <= 1e-6


@pytest.mark.parametrize(("name", "form", "weights"), [("frustum_mixed", "tiles", "mixed"), ("grid_fp16", "ell", "fp16"), ("region_mixed", "ell", "mixed")])
def test_guarded_and_reduced_lifts_export_static_and_run_in_onnxruntime(tmp_path: Path, stores: dict[str, Path], name: str, form: str, weights: str) -> None:
    """The guard adds Sub, Equal, Where (one each per input) and nothing forbidden; in
    onnxruntime a NaN pixel of camera 0 leaves every cell camera 0 does not feed equal to the
    clean output, and the result matches torch."""
    store = stores[name]
    rig = load(store).rig
    module = MatrixLift(store, form=form, weights=weights, guard=True)
    features, depth = _inputs(rig, n=1)
    frustum = module.mode == "frustum"
    args = (features, depth) if frustum else (features,)
    scan, session = _export(module, args, tmp_path / "lift.onnx", ["features", "depth"][: len(args)])
    assert set(scan.unexpected) <= {"Sub", "Equal", "Where"}, scan.unexpected
    assert scan.op_histogram["Where"] == len(args) and scan.op_histogram["Sub"] == len(args)
    clean = session.run(None, {"features": features.numpy()} | ({"depth": depth.numpy()} if frustum else {}))[0]
    assert np.max(np.abs(clean - module(*args).numpy())) <= 1e-6 * max(1.0, float(np.abs(clean).max()))
    dirty = features.clone()
    dirty[0, 0, :, 0, 0] = float("nan")
    out = session.run(None, {"features": dirty.numpy()} | ({"depth": depth.numpy()} if frustum else {}))[0]
    others = ~_fed_by(store, 0).numpy()
    assert np.isfinite(out).all()
    assert np.array_equal(out[..., others], clean[..., others])
