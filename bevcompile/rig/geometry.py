"""Camera geometry: rigid transforms, lens models, image augmentation, feature-map pixels.

Pure numpy; every function takes a config dataclass and arrays and returns new arrays.

Frames and pixel chain (see docs/conventions.md)::

    points_bev --(cam_from_bev)--> points_cam --(lens)--> uv_image_px
        --(image_aug)--> uv_input_px --(feature.pixel_mapping)--> uv_feature_px

* ego: x forward, y left, z up, metres.
* BEV frame (``bev.frame``): ego, or the frame of one of the rig's sensors (e.g. nuScenes
  ``LIDAR_TOP``: x right, y forward, z up). Every product works in it: ``points_bev =
  inv(ego_from_sensor) @ points_ego``, and a camera's pose in it is ``bev_from_cam =
  inv(ego_from_sensor) @ ego_from_cam`` (:func:`bev_from_cam_matrix`); with ``bev.frame: ego``
  it IS ``ego_from_cam`` (same bytes).
* camera: OpenCV (x right, y down, z = optical axis), metres.
* pixels: ``(u, v)`` = (column, row); integer values are pixel centres (OpenCV).
* image augmentation (BEVDet ``post_rot``/``post_tran``): ``u_in = u_image * resize - crop_left``;
  right/bottom padding of the network input (``image_aug.pad``) leaves coordinates unchanged;
  ``image_aug.flip`` mirrors the crop as Fast-BEV's ``img_transform`` does,
  ``u_in = W_crop - (u_image * resize - crop_left)`` with ``W_crop = input_width - pad_right``
  (:func:`image_px_to_input_px`).
* feature map, ``stride`` mapping: ``u_f = (u_in - (s - 1) / 2) / s``;
  ``linspace`` mapping: ``u_f = u_in * (W_f - 1) / (W_in - 1)``; ``corner`` mapping:
  ``u_f = u_in / s``; ``normalized`` mapping: ``u_f = u_in * W_f / W_in - 1/2`` (``= u_in/s - 1/2``
  when ``W_in = s W_f``; with ``feature.size_rule: ceil`` ``W_f = ceil(W_in / s)``). One feature
  level at a time: a multi-level rig is projected through :meth:`RigConfig.level`.

Lens models follow OpenCV exactly: ``none`` (pinhole), ``opencv`` (radial-tangential with the
rational extension, coefficients ``k1 k2 p1 p2 k3 k4 k5 k6``) and ``fisheye``
(``cv2.fisheye``: equidistant ``theta_d = theta (1 + k1 theta^2 + ... + k4 theta^8)``).

Validity: a point is projectable only if it lies in front of the camera
(``z_cam > MIN_DEPTH_M``) and inside the lens model's *valid field* (the README's "monotonic
field of view"):

* radial: its undistorted radius ``r = tan(angle off axis)`` is below the radial fold, the
  first radius where the radial mapping stops increasing (or an OpenCV rational denominator
  reaches 0). Past it the polynomial folds back and a far-off-axis point would wrap around
  into the image.
* ``opencv``, 2-D: the Jacobian determinant of the full normalised distortion map (radial
  ``k1..k6`` and tangential ``p1, p2``) is ``> 0``. With tangential terms the 2-D map can fold
  a little before the radial fold; a point there shares its pixel with another, valid ray.
* ``fisheye``: the fold is searched in ``r`` up to ``_FOV_SEARCH_MAX`` (89.94 deg), then in the
  angle ``theta`` itself up to 90 deg; ``theta >= 90 deg`` is never valid, and a fisheye that
  is monotonic on ``[0, 90 deg)`` is valid for every point in front of the camera.

Points outside the valid field are reported invalid, never wrapped into the image. The lift
(:func:`undistort_normalized`) follows the same rule: a pixel gives a ray only if that ray is
inside the valid field and reproduces the pixel to 1e-9.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from .config import Camera, Distortion, RigConfig

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

MIN_DEPTH_M = 1e-6
"""Points with camera-frame depth ``z_cam <= MIN_DEPTH_M`` are behind (or on) the camera plane."""

_FOV_SEARCH_MAX = 1e3  # largest undistorted radius tan(angle) of the radius search (89.94 deg)
_HALF_PI = float(np.pi / 2)  # fisheye: theta >= 90 deg off-axis is at or behind the image plane


# --------------------------------------------------------------------------------------
# rigid transforms
# --------------------------------------------------------------------------------------


def ego_from_cam_matrix(camera: Camera) -> FloatArray:
    """4x4 float64 rigid transform camera -> ego."""
    return np.array(camera.ego_from_cam, dtype=np.float64)


def cam_from_ego_matrix(camera: Camera) -> FloatArray:
    """4x4 float64 rigid transform ego -> camera (exact inverse of a rigid transform; -R^T t
    written out, see :func:`transform_points`: no BLAS in the geometry path)."""
    return _rigid_inverse(ego_from_cam_matrix(camera))


def _rigid_inverse(matrix: FloatArray) -> FloatArray:
    """Exact inverse of a rigid 4x4 ``[R | t]``: ``[R^T | -R^T t]`` (elementwise, no BLAS)."""
    rotation = matrix[:3, :3]
    translation = matrix[:3, 3]
    inverse = np.eye(4)
    inverse[:3, :3] = rotation.T
    for i in range(3):
        inverse[i, 3] = -(rotation[0, i] * translation[0] + rotation[1, i] * translation[1] + rotation[2, i] * translation[2])
    return inverse


def bev_from_ego_matrix(rig: RigConfig) -> FloatArray:
    """4x4 float64 rigid transform ego -> BEV frame: the identity for ``bev.frame: ego``, else
    ``inv(ego_from_sensor)`` of the frame's sensor."""
    sensor = rig.bev_frame_sensor
    if sensor is None:
        return np.eye(4)
    return _rigid_inverse(np.array(sensor.ego_from_sensor, dtype=np.float64))


def bev_from_cam_matrix(rig: RigConfig, camera: Camera) -> FloatArray:
    """4x4 float64 rigid transform camera -> BEV frame (the pose every product uses).

    ``bev.frame: ego``: ``ego_from_cam`` itself. A sensor frame: ``R = R_s^T R_c``,
    ``t = R_s^T (t_c - t_s)`` with ``ego_from_sensor = [R_s | t_s]``, ``ego_from_cam = [R_c | t_c]``
    (mmdet3d's ``sensor2lidar`` of one static pose), written elementwise in a fixed order.
    """
    ego_from_cam = ego_from_cam_matrix(camera)
    sensor = rig.bev_frame_sensor
    if sensor is None:
        return ego_from_cam
    ego_from_sensor = np.array(sensor.ego_from_sensor, dtype=np.float64)
    r_s, t_s = ego_from_sensor[:3, :3], ego_from_sensor[:3, 3]
    r_c, t_c = ego_from_cam[:3, :3], ego_from_cam[:3, 3]
    out = np.eye(4)
    d = [t_c[k] - t_s[k] for k in range(3)]
    for i in range(3):
        for j in range(3):
            out[i, j] = r_s[0, i] * r_c[0, j] + r_s[1, i] * r_c[1, j] + r_s[2, i] * r_c[2, j]
        out[i, 3] = r_s[0, i] * d[0] + r_s[1, i] * d[1] + r_s[2, i] * d[2]
    return out


def cam_from_bev_matrix(rig: RigConfig, camera: Camera) -> FloatArray:
    """4x4 float64 rigid transform BEV frame -> camera (exact inverse of :func:`bev_from_cam_matrix`)."""
    return _rigid_inverse(bev_from_cam_matrix(rig, camera))


def transform_points(matrix_4x4: FloatArray, points: FloatArray) -> FloatArray:
    """Apply a 4x4 rigid transform.

    Convention:
        points: ``(..., 3)`` float64 metres ``(x, y, z)`` in the source frame.
        returns: ``(..., 3)`` float64 metres in the target frame,
        ``out_i = ((m_i0 x + m_i1 y) + m_i2 z) + t_i``.

    Written as elementwise multiply-adds in that fixed order, not ``points @ R.T``: a BLAS
    matmul picks its kernel (and its use of fused multiply-add) by CPU, so its last bit can
    differ between machines; IEEE elementwise ``*`` and ``+`` give the same bytes everywhere.
    """
    points = np.asarray(points, dtype=np.float64)
    x, y, z = points[..., 0], points[..., 1], points[..., 2]
    m = np.asarray(matrix_4x4, dtype=np.float64)
    return np.stack([m[i, 0] * x + m[i, 1] * y + m[i, 2] * z + m[i, 3] for i in range(3)], axis=-1)


# --------------------------------------------------------------------------------------
# lens models on normalised coordinates
# --------------------------------------------------------------------------------------


def _radial_factor(coeffs: tuple[float, ...], r2: FloatArray) -> tuple[FloatArray, FloatArray]:
    """OpenCV rational radial factor and its derivative w.r.t. r2."""
    k1, k2, _p1, _p2, k3, k4, k5, k6 = coeffs
    num = 1.0 + r2 * (k1 + r2 * (k2 + r2 * k3))
    den = 1.0 + r2 * (k4 + r2 * (k5 + r2 * k6))
    dnum = k1 + r2 * (2.0 * k2 + 3.0 * k3 * r2)
    dden = k4 + r2 * (2.0 * k5 + 3.0 * k6 * r2)
    factor = num / den
    dfactor = (dnum * den - num * dden) / (den * den)
    return factor, dfactor


def _opencv_jacobian(
    coeffs: tuple[float, ...], x: FloatArray, y: FloatArray
) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
    """Analytic Jacobian ``(dx_d/dx, dx_d/dy, dy_d/dx, dy_d/dy)`` of the full OpenCV normalised
    distortion map ``x_d = x f + 2 p1 x y + p2 (r^2 + 2 x^2)``,
    ``y_d = y f + p1 (r^2 + 2 y^2) + 2 p2 x y`` (``f`` the rational radial factor of ``r^2``)."""
    k_p1, k_p2 = coeffs[2], coeffs[3]
    r2 = x * x + y * y
    factor, dfactor = _radial_factor(coeffs, r2)
    j11 = factor + 2 * x * x * dfactor + 2 * k_p1 * y + 6 * k_p2 * x
    j12 = 2 * x * y * dfactor + 2 * k_p1 * x + 2 * k_p2 * y
    j21 = 2 * x * y * dfactor + 2 * k_p1 * x + 2 * k_p2 * y
    j22 = factor + 2 * y * y * dfactor + 6 * k_p1 * y + 2 * k_p2 * x
    return j11, j12, j21, j22


_FOLD_RAY_SAMPLES = 128
"""Points ``t (x, y)``, ``t = k / 128``, at which the 2-D fold test looks along each ray."""
_FOLD_RAY_CHUNK = 4096


def _jacobian_det(coeffs: tuple[float, ...], x: FloatArray, y: FloatArray) -> FloatArray:
    """``det`` of :func:`_opencv_jacobian` at ``(x, y)`` (NaN at a pole or on overflow, no warning)."""
    with np.errstate(all="ignore"):
        j11, j12, j21, j22 = _opencv_jacobian(coeffs, x, y)
        return np.asarray(j11 * j22 - j12 * j21, dtype=np.float64)


def _unfolded_along_ray(coeffs: tuple[float, ...], x: FloatArray, y: FloatArray, candidates: BoolArray) -> BoolArray:
    """``det J > 0`` at ``(x, y)`` AND along the ray from the optical axis to it (at
    ``t (x, y)``, ``t = k / _FOLD_RAY_SAMPLES``): the valid field ends at the FIRST 2-D fold of
    each ray, so a ray that crosses a band of ``det J <= 0`` and comes out positive again stays
    invalid beyond it (its pixels belong to nearer, valid rays). Only ``candidates`` are tested
    along the ray. Without tangential terms ``det J = f (r f)'`` is positive wherever the radial
    rule holds, so the point test suffices there.
    """
    unfolded = _jacobian_det(coeffs, x, y) > 0  # NaN (pole, overflow) -> False
    if coeffs[2] == 0.0 and coeffs[3] == 0.0:
        return unfolded
    unfolded = unfolded.copy()
    test = np.flatnonzero(np.broadcast_to(unfolded & candidates, unfolded.shape).ravel())
    flat = unfolded.reshape(-1)
    xs_all, ys_all = np.broadcast_to(x, unfolded.shape).reshape(-1), np.broadcast_to(y, unfolded.shape).reshape(-1)
    t = np.arange(1, _FOLD_RAY_SAMPLES, dtype=np.float64) / _FOLD_RAY_SAMPLES
    for start in range(0, test.size, _FOLD_RAY_CHUNK):
        idx = test[start : start + _FOLD_RAY_CHUNK]
        flat[idx] = np.all(_jacobian_det(coeffs, xs_all[idx, None] * t, ys_all[idx, None] * t) > 0, axis=1)
    return unfolded


def opencv_jacobian_det(distortion: Distortion, xy: FloatArray) -> FloatArray:
    """Determinant of the Jacobian of the full OpenCV distortion map (radial ``k1..k6`` and
    tangential ``p1, p2``) at undistorted normalised ``xy`` ``(..., 2)``; float64 ``(...)``.
    Where it is ``<= 0`` the 2-D map has folded over: such points are outside the valid field."""
    xy = np.asarray(xy, dtype=np.float64)
    return _jacobian_det(distortion.coeffs, xy[..., 0], xy[..., 1])


def _fisheye_theta_d(coeffs: tuple[float, ...], theta: FloatArray) -> tuple[FloatArray, FloatArray]:
    """``cv2.fisheye`` distorted angle ``theta_d(theta)`` and ``d theta_d / d theta``."""
    k1, k2, k3, k4 = coeffs
    t2 = theta * theta
    poly = 1.0 + t2 * (k1 + t2 * (k2 + t2 * (k3 + t2 * k4)))
    dpoly = 1.0 + t2 * (3 * k1 + t2 * (5 * k2 + t2 * (7 * k3 + t2 * 9 * k4)))
    return theta * poly, dpoly


@dataclass(frozen=True)
class LensLimits:
    """Valid field of view of a lens model.

    ``max_radius``: the undistorted normalised radius ``r = tan(angle off axis)`` where the
    radial mapping folds back; points are valid only strictly inside it (``inf`` for pinhole,
    for an OpenCV lens that never folds and for a fisheye that is monotonic up to 90 deg);
    ``max_distorted_radius``: its image under the radial mapping (for fisheye ``theta_d``; for
    a fisheye monotonic up to 90 deg, ``theta_d(pi / 2)``, the supremum, never reached).
    """

    max_radius: float
    max_distorted_radius: float

    @property
    def max_angle_deg(self) -> float:
        return float(np.degrees(np.arctan(self.max_radius)))


def _distorted_radius(distortion: Distortion, r: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Radial part of the model: distorted radius and d/dr, for radius r = tan(theta)."""
    if distortion.model == "opencv":
        factor, dfactor = _radial_factor(distortion.coeffs, r * r)
        return r * factor, factor + 2.0 * r * r * dfactor
    if distortion.model == "fisheye":
        k1, k2, k3, k4 = distortion.coeffs
        theta = np.arctan(r)
        t2 = theta * theta
        poly = 1.0 + t2 * (k1 + t2 * (k2 + t2 * (k3 + t2 * k4)))
        dpoly = 1.0 + t2 * (3 * k1 + t2 * (5 * k2 + t2 * (7 * k3 + t2 * 9 * k4)))
        return theta * poly, dpoly / (1.0 + r * r)
    return r.copy(), np.ones_like(r)


@lru_cache(maxsize=256)
def lens_limits(distortion: Distortion) -> LensLimits:
    """Monotonic field of view of ``distortion``: the radius where the radial mapping first
    stops increasing (or its rational denominator reaches 0).

    OpenCV lenses are searched over ``r = tan(angle)`` up to ``_FOV_SEARCH_MAX`` (89.94 deg; a
    lens still increasing there never folds: ``inf``). Fisheye lenses are searched over the
    same range and, past it, over the angle ``theta`` itself up to 90 deg (``theta >= 90 deg``
    is at or behind the image plane and never valid): a fisheye monotonic on ``[0, 90 deg)``
    gets ``max_radius = inf``, i.e. every point in front of the camera.
    """
    if distortion.model == "none":
        return LensLimits(float("inf"), float("inf"))
    with np.errstate(all="ignore"):  # the scan runs into rational poles and overflow on purpose
        return _lens_limits_scan(distortion)


def _lens_limits_scan(distortion: Distortion) -> LensLimits:
    # Log-spaced scan of r = tan(theta), then bisection on the derivative sign.
    r = np.concatenate([[0.0], np.geomspace(1e-4, _FOV_SEARCH_MAX, 200_001)])
    rd, drd = _distorted_radius(distortion, r)
    bad = ~np.isfinite(rd) | ~np.isfinite(drd) | (drd <= 0)
    if distortion.model == "opencv":
        k4, k5, k6 = distortion.coeffs[5:8]
        r2 = r * r
        bad |= (1.0 + r2 * (k4 + r2 * (k5 + r2 * k6))) <= 0
    if not bad.any():
        if distortion.model == "fisheye":
            return _fisheye_limits_past_search_max(distortion)
        return LensLimits(float("inf"), float("inf"))
    first = int(np.argmax(bad))
    if first == 0:
        return LensLimits(0.0, 0.0)
    lo, hi = float(r[first - 1]), float(r[first])
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        rd_mid, drd_mid = _distorted_radius(distortion, np.array([mid]))
        ok = np.isfinite(rd_mid[0]) and drd_mid[0] > 0
        if ok and distortion.model == "opencv":
            k4, k5, k6 = distortion.coeffs[5:8]
            m2 = mid * mid
            ok = bool(1.0 + m2 * (k4 + m2 * (k5 + m2 * k6)) > 0)
        lo, hi = (mid, hi) if ok else (lo, mid)
    rd_lo, _ = _distorted_radius(distortion, np.array([lo]))
    return LensLimits(lo, float(rd_lo[0]))


def _fisheye_limits_past_search_max(distortion: Distortion) -> LensLimits:
    """Fisheye monotonic up to ``r = _FOV_SEARCH_MAX``: continue the search in ``theta`` up
    to 90 deg, where ``tan`` is useless (``r`` runs to infinity)."""
    theta = np.linspace(float(np.arctan(_FOV_SEARCH_MAX)), _HALF_PI, 100_001)
    theta_d, dtheta_d = _fisheye_theta_d(distortion.coeffs, theta)
    bad = ~np.isfinite(theta_d) | ~np.isfinite(dtheta_d) | (dtheta_d <= 0)
    if not bad.any():
        return LensLimits(float("inf"), float(_fisheye_theta_d(distortion.coeffs, np.array([_HALF_PI]))[0][0]))
    first = int(np.argmax(bad))
    lo, hi = float(theta[max(first - 1, 0)]), float(theta[first])
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        value, slope = _fisheye_theta_d(distortion.coeffs, np.array([mid]))
        ok = bool(np.isfinite(value[0]) and np.isfinite(slope[0]) and slope[0] > 0)
        lo, hi = (mid, hi) if ok else (lo, mid)
    theta_d_lo, _ = _fisheye_theta_d(distortion.coeffs, np.array([lo]))
    return LensLimits(float(np.tan(lo)), float(theta_d_lo[0]))


def distort_normalized(distortion: Distortion, xy: FloatArray) -> tuple[FloatArray, BoolArray]:
    """Apply the lens model to undistorted normalised coordinates.

    Convention:
        xy: ``(..., 2)`` float64 ``(x, y) = (X/Z, Y/Z)`` in the camera frame (unitless).
        returns: distorted normalised ``(x_d, y_d)`` ``(..., 2)`` float64, and a bool ``(...)``
        mask, False where the point lies outside the model's valid field (see the module
        docstring: past the radial fold, or, for ``opencv``, where the 2-D map has folded,
        ``det J <= 0``; for ``fisheye``, at 90 deg or more off-axis).
        Matches OpenCV ``projectPoints`` / ``fisheye.projectPoints`` term for term.
    """
    xy = np.asarray(xy, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # huge or non-finite input: masked below
        x = xy[..., 0]
        y = xy[..., 1]
        r2 = x * x + y * y
        limits = lens_limits(distortion)
        inside = np.sqrt(r2) < limits.max_radius if np.isfinite(limits.max_radius) else np.isfinite(r2)
        if distortion.model == "none":
            return xy.copy(), inside
        if distortion.model == "opencv":
            p1, p2 = distortion.coeffs[2], distortion.coeffs[3]
            factor, _ = _radial_factor(distortion.coeffs, r2)
            xd = x * factor + 2.0 * p1 * x * y + p2 * (r2 + 2.0 * x * x)
            yd = y * factor + p1 * (r2 + 2.0 * y * y) + 2.0 * p2 * x * y
            unfolded = _unfolded_along_ray(distortion.coeffs, x, y, inside)
            return np.stack([xd, yd], axis=-1), inside & np.isfinite(xd) & np.isfinite(yd) & unfolded
        # fisheye (cv2.fisheye.projectPoints)
        k1, k2, k3, k4 = distortion.coeffs
        r = np.sqrt(r2)
        theta = np.arctan(r)
        t2 = theta * theta
        theta_d = theta * (1.0 + t2 * (k1 + t2 * (k2 + t2 * (k3 + t2 * k4))))
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(r > 1e-8, theta_d / np.where(r > 1e-8, r, 1.0), 1.0)
        return np.stack([x * scale, y * scale], axis=-1), inside & (theta < _HALF_PI)


def undistort_normalized(distortion: Distortion, xy_distorted: FloatArray) -> tuple[FloatArray, BoolArray]:
    """Invert :func:`distort_normalized` (exact to ~1e-12, not OpenCV's 5-iteration estimate).

    Convention:
        xy_distorted: ``(..., 2)`` float64 distorted normalised coordinates.
        returns: undistorted ``(x, y)`` ``(..., 2)`` float64 and a bool mask, False where
        the input has no preimage inside the valid field (:func:`distort_normalized`'s mask)
        or the solve does not reproduce it (``|distort(xy) - xy_distorted| >= 1e-9``);
        invalid entries hold NaN.

    Solve: radial-only bisection on ``[0, min(max_radius, _FOV_SEARCH_MAX)]``, then (opencv)
    12 Newton steps on the full model. Where that fails or has not converged (near a fold of
    a lens with tangential terms; a fisheye past 89.94 deg) a safeguarded solve takes over:
    opencv, damped Newton that never leaves the valid field (``r < max_radius``,
    ``det J > 0``); fisheye, bisection on the angle ``theta``.
    """
    xy_distorted = np.asarray(xy_distorted, dtype=np.float64)
    if distortion.model == "none":
        return xy_distorted.copy(), np.all(np.isfinite(xy_distorted), axis=-1)
    limits = lens_limits(distortion)
    xd = xy_distorted[..., 0]
    yd = xy_distorted[..., 1]
    rd = np.hypot(xd, yd)
    finite = np.isfinite(rd)
    rd = np.where(finite, rd, 0.0)
    # 1. Radial-only inverse by safeguarded bisection on [0, max_radius] (monotonic there).
    hi_r = min(limits.max_radius, _FOV_SEARCH_MAX)
    lo = np.zeros_like(rd)
    hi = np.full_like(rd, hi_r)
    with np.errstate(all="ignore"):  # extreme coefficients overflow: caught by the checks below
        for _ in range(64):
            mid = 0.5 * (lo + hi)
            value, _ = _distorted_radius(distortion, mid)
            greater = value > rd
            hi = np.where(greater, mid, hi)
            lo = np.where(greater, lo, mid)
        r = 0.5 * (lo + hi)
        rd_check, _ = _distorted_radius(distortion, r)
        scale = np.where(rd > 1e-15, r / np.where(rd > 1e-15, rd, 1.0), 1.0)
    x = xd * scale
    y = yd * scale
    if distortion.model == "opencv":
        # 2. Newton on the full radial-tangential model, from the radial estimate.
        k_p1, k_p2 = distortion.coeffs[2], distortion.coeffs[3]
        with np.errstate(all="ignore"):  # a diverging start is caught by the checks below
            for _ in range(12):
                r2 = x * x + y * y
                factor, dfactor = _radial_factor(distortion.coeffs, r2)
                fx = x * factor + 2 * k_p1 * x * y + k_p2 * (r2 + 2 * x * x) - xd
                fy = y * factor + k_p1 * (r2 + 2 * y * y) + 2 * k_p2 * x * y - yd
                j11 = factor + 2 * x * x * dfactor + 2 * k_p1 * y + 6 * k_p2 * x  # = _opencv_jacobian
                j12 = 2 * x * y * dfactor + 2 * k_p1 * x + 2 * k_p2 * y
                j21 = 2 * x * y * dfactor + 2 * k_p1 * x + 2 * k_p2 * y
                j22 = factor + 2 * y * y * dfactor + 6 * k_p1 * y + 2 * k_p2 * x
                det = j11 * j22 - j12 * j21
                dx = (j22 * fx - j12 * fy) / det
                dy = (j11 * fy - j21 * fx) / det
                dx = np.where(np.isfinite(dx), dx, 0.0)
                dy = np.where(np.isfinite(dy), dy, 0.0)
                x = x - dx
                y = y - dy
    xy = np.stack([x, y], axis=-1)
    redistorted, inside = distort_normalized(distortion, xy)
    residual = np.max(np.abs(redistorted - xy_distorted), axis=-1) if xy.size else np.zeros(rd.shape)
    ok = finite & inside & (rd <= limits.max_distorted_radius) & (residual < 1e-9)
    ok &= np.abs(rd_check - rd) < 1e-6
    # 3. Safeguarded solve where step 2 failed or has not converged.
    if distortion.model == "opencv":
        retry = finite & (~ok | ~_newton_converged(distortion, xy, redistorted - xy_distorted))
    else:  # fisheye: near r = _FOV_SEARCH_MAX bisection on r is coarse in angle; beyond it, stuck
        retry = finite & (~ok | (r > 0.5 * _FOV_SEARCH_MAX))
    if retry.any():
        ok = np.array(ok, dtype=np.bool_)  # writable, also for a single point
        if distortion.model == "opencv":
            xy[retry] = _opencv_solve_in_field(distortion, xy_distorted[retry], xy[retry], limits)
        else:
            xy[retry] = _fisheye_solve_theta(distortion, xy_distorted[retry], limits)
        redistorted_retry, inside_retry = distort_normalized(distortion, xy[retry])
        residual_retry = np.max(np.abs(redistorted_retry - xy_distorted[retry]), axis=-1)
        ok[retry] = inside_retry & (residual_retry < 1e-9)
        ok = ok[()]
    xy = np.where(ok[..., None], xy, np.nan)
    return xy, ok


_CONVERGED_STEP = 1e-12
"""An OpenCV inverse whose next Newton step is longer than this (normalised units, relative
to ``max(1, r)``) is not accepted as converged and goes to the safeguarded solve."""


def _newton_converged(distortion: Distortion, xy: FloatArray, residual: FloatArray) -> BoolArray:
    """True where the next Newton step from ``xy`` (residual ``distort(xy) - target``) is
    below ``_CONVERGED_STEP``: the solve has reached float64 precision, also near a fold
    where ``det J`` is small and a small residual alone does not bound the error."""
    with np.errstate(all="ignore"):
        x, y = xy[..., 0], xy[..., 1]
        j11, j12, j21, j22 = _opencv_jacobian(distortion.coeffs, x, y)
        det = j11 * j22 - j12 * j21
        dx = (j22 * residual[..., 0] - j12 * residual[..., 1]) / det
        dy = (j11 * residual[..., 1] - j21 * residual[..., 0]) / det
        step = np.maximum(np.abs(dx), np.abs(dy))
        return np.asarray(step <= _CONVERGED_STEP * np.maximum(1.0, np.hypot(x, y)), dtype=np.bool_)


def _opencv_field_map(distortion: Distortion, x: FloatArray, y: FloatArray) -> tuple[FloatArray, FloatArray, BoolArray]:
    """:func:`distort_normalized` on separate ``x``, ``y``: ``(x_d, y_d, inside the valid field)``."""
    xy_d, inside = distort_normalized(distortion, np.stack([x, y], axis=-1))
    return xy_d[..., 0], xy_d[..., 1], inside


def _opencv_reachable(distortion: Distortion, limits: LensLimits, target: FloatArray) -> BoolArray:
    """False where ``target`` is provably not the image of any point of the valid field: for
    ``r < max_radius`` the radial part has length ``< max_distorted_radius`` and the
    tangential part at most ``|(|p1| + 3 |p2|, 3 |p1| + |p2|)| r^2``."""
    if not np.isfinite(limits.max_radius):
        return np.ones(target.shape[:-1], dtype=np.bool_)
    p1, p2 = abs(distortion.coeffs[2]), abs(distortion.coeffs[3])
    bound = limits.max_distorted_radius + float(np.hypot(p1 + 3 * p2, 3 * p1 + p2)) * limits.max_radius**2
    return np.asarray(np.hypot(target[..., 0], target[..., 1]) <= bound * (1 + 1e-9), dtype=np.bool_)


_SAFE_NEWTON_ITERATIONS = 50
_SAFE_NEWTON_HALVINGS = 40


def _opencv_solve_in_field(distortion: Distortion, target: FloatArray, start: FloatArray, limits: LensLimits) -> FloatArray:
    """Damped Newton for ``distort(xy) = target`` that stays inside the valid field.

    Start: ``start`` where it is inside the field, else the point in the target's direction
    just inside ``max_radius``, halved towards the axis until it is inside (the axis always
    is). Each step is the Newton step, halved (at most ``_SAFE_NEWTON_HALVINGS`` times) until
    the point is inside the field and the squared residual strictly decreases; a point where
    no step decreases it stays put. At most ``_SAFE_NEWTON_ITERATIONS`` steps (a start near
    the solution needs < 10). The result depends on each point alone, not on the batch, so
    chunked builds are identical. Returns NaN for targets that are provably out of reach.
    """
    n = target.shape[0]
    out = np.full((n, 2), np.nan)
    reachable = _opencv_reachable(distortion, limits, target)
    if limits.max_radius <= 0.0 or not reachable.any():
        return out
    tx, ty = target[reachable, 0], target[reachable, 1]
    with np.errstate(all="ignore"):
        x = np.where(np.isfinite(start[reachable, 0]), start[reachable, 0], 0.0)
        y = np.where(np.isfinite(start[reachable, 1]), start[reachable, 1], 0.0)
        xd, yd, feasible = _opencv_field_map(distortion, x, y)
        if not feasible.all():
            rd = np.hypot(tx, ty)
            ux = np.where(rd > 0, tx / np.where(rd > 0, rd, 1.0), 0.0)
            uy = np.where(rd > 0, ty / np.where(rd > 0, rd, 1.0), 0.0)
            radius = min(limits.max_radius, _FOV_SEARCH_MAX) * (1.0 - 1e-9)
            for _ in range(64):
                cxd, cyd, fix = _opencv_field_map(distortion, ux * radius, uy * radius)
                fix &= ~feasible
                x, y = np.where(fix, ux * radius, x), np.where(fix, uy * radius, y)
                xd, yd = np.where(fix, cxd, xd), np.where(fix, cyd, yd)
                feasible |= fix
                if feasible.all():
                    break
                radius *= 0.5
        merit = np.where(feasible, (xd - tx) ** 2 + (yd - ty) ** 2, np.inf)
        for _ in range(_SAFE_NEWTON_ITERATIONS):
            j11, j12, j21, j22 = _opencv_jacobian(distortion.coeffs, x, y)
            det = j11 * j22 - j12 * j21
            fx, fy = xd - tx, yd - ty
            dx = (j22 * fx - j12 * fy) / det
            dy = (j11 * fy - j21 * fx) / det
            pending = feasible & np.isfinite(dx) & np.isfinite(dy) & (merit > 0)
            moved = np.zeros(x.shape, dtype=np.bool_)
            step = 1.0
            for _h in range(_SAFE_NEWTON_HALVINGS):
                if not pending.any():
                    break
                idx = np.flatnonzero(pending)
                cx, cy = x[idx] - step * dx[idx], y[idx] - step * dy[idx]
                cxd, cyd, inside = _opencv_field_map(distortion, cx, cy)
                c_merit = (cxd - tx[idx]) ** 2 + (cyd - ty[idx]) ** 2
                take = inside & (c_merit < merit[idx])
                hit = idx[take]
                x[hit], y[hit], xd[hit], yd[hit], merit[hit] = cx[take], cy[take], cxd[take], cyd[take], c_merit[take]
                moved[hit] = True
                pending[hit] = False
                step *= 0.5
            if not moved.any():
                break
        solved = np.stack([x, y], axis=-1)
    out[reachable] = np.where(feasible[:, None], solved, np.nan)
    return out


def _fisheye_solve_theta(distortion: Distortion, target: FloatArray, limits: LensLimits) -> FloatArray:
    """Fisheye inverse by bisection on the angle ``theta`` in ``[0, theta_max]`` (monotonic
    there): ``theta_max = atan(max_radius)``, or 90 deg for a lens monotonic up to 90 deg.
    Exact also past ``_FOV_SEARCH_MAX``, where bisection on ``r = tan(theta)`` cannot go."""
    theta_max = float(np.arctan(limits.max_radius)) if np.isfinite(limits.max_radius) else _HALF_PI
    rd = np.hypot(target[:, 0], target[:, 1])
    lo = np.zeros_like(rd)
    hi = np.full_like(rd, theta_max)
    with np.errstate(all="ignore"):
        for _ in range(64):
            mid = 0.5 * (lo + hi)
            value, _ = _fisheye_theta_d(distortion.coeffs, mid)
            greater = value > rd
            hi = np.where(greater, mid, hi)
            lo = np.where(greater, lo, mid)
        theta = 0.5 * (lo + hi)
        value, _ = _fisheye_theta_d(distortion.coeffs, theta)
        reachable = np.isfinite(rd) & (np.abs(value - rd) < 1e-6)
        if np.isfinite(limits.max_radius):
            reachable &= rd <= limits.max_distorted_radius
        else:
            reachable &= rd < limits.max_distorted_radius
        r = np.tan(theta)
        scale = np.where(rd > 1e-15, r / np.where(rd > 1e-15, rd, 1.0), 1.0)
        out = np.stack([target[:, 0] * scale, target[:, 1] * scale], axis=-1)
    return np.where(reachable[:, None], out, np.nan)


# --------------------------------------------------------------------------------------
# pixel chain
# --------------------------------------------------------------------------------------


def image_px_to_input_px(camera: Camera, uv_image_px: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Calibrated-image pixel -> network-input pixel (``image_aug``: resize, crop, flip).

    Convention:
        uv_image_px: ``(..., 2)`` float64 ``(u, v)``; returns ``(u_in, v_in)``, each ``(...)``
        float64: ``u_in = u * resize - crop_left`` (``flip``: ``W_crop - (u * resize - crop_left)``,
        ``W_crop = input_width - pad_right``, Fast-BEV's ``img_transform``), ``v_in = v * resize - crop_top``.
    """
    aug = camera.image_aug
    uv = np.asarray(uv_image_px, dtype=np.float64)
    u_in = uv[..., 0] * aug.resize - aug.crop_left
    if aug.flip:
        u_in = aug.crop_width - u_in
    return u_in, uv[..., 1] * aug.resize - aug.crop_top


def input_px_to_image_px(camera: Camera, u_in: FloatArray, v_in: FloatArray) -> FloatArray:
    """Inverse of :func:`image_px_to_input_px`: ``(..., 2)`` float64 calibrated-image ``(u, v)``."""
    aug = camera.image_aug
    u = aug.crop_width - u_in if aug.flip else u_in
    return np.stack([(u + aug.crop_left) / aug.resize, (v_in + aug.crop_top) / aug.resize], axis=-1)


def image_px_to_feature_px(rig: RigConfig, camera: Camera, uv_image_px: FloatArray) -> FloatArray:
    """Calibrated-image pixel -> feature-map pixel (augmentation, then stride/linspace).

    Convention:
        uv_image_px: ``(..., 2)`` float64 ``(u, v)`` calibrated image pixels, centres at integers.
        returns: ``(..., 2)`` float64 ``(u, v)`` feature-map pixels, centres at integers.
    """
    aug = camera.image_aug
    u_in, v_in = image_px_to_input_px(camera, uv_image_px)
    s = rig.feature.stride
    mapping = rig.feature.pixel_mapping
    if mapping == "stride":
        u_f = (u_in - (s - 1) / 2.0) / s
        v_f = (v_in - (s - 1) / 2.0) / s
    elif mapping == "corner":
        u_f = u_in / s
        v_f = v_in / s
    elif mapping == "normalized":
        # u_in * W_f / W_in - 1/2, written as u_in / (W_in / W_f): W_in / W_f is exactly s when
        # the input is divisible (size_rule exact), so those stores keep their bytes
        w_f, h_f = rig.feature_size
        u_f = u_in / (aug.input_width / w_f) - 0.5
        v_f = v_in / (aug.input_height / h_f) - 0.5
    else:
        w_f, h_f = rig.feature_size
        u_f = u_in * (w_f - 1) / (aug.input_width - 1)
        v_f = v_in * (h_f - 1) / (aug.input_height - 1)
    return np.stack([u_f, v_f], axis=-1)


def feature_px_to_image_px(rig: RigConfig, camera: Camera, uv_feature_px: FloatArray) -> FloatArray:
    """Inverse of :func:`image_px_to_feature_px` (same conventions, reversed)."""
    aug = camera.image_aug
    uv = np.asarray(uv_feature_px, dtype=np.float64)
    s = rig.feature.stride
    mapping = rig.feature.pixel_mapping
    if mapping == "stride":
        u_in = uv[..., 0] * s + (s - 1) / 2.0
        v_in = uv[..., 1] * s + (s - 1) / 2.0
    elif mapping == "corner":
        u_in = uv[..., 0] * s
        v_in = uv[..., 1] * s
    elif mapping == "normalized":
        w_f, h_f = rig.feature_size
        u_in = (uv[..., 0] + 0.5) * (aug.input_width / w_f)
        v_in = (uv[..., 1] + 0.5) * (aug.input_height / h_f)
    else:
        w_f, h_f = rig.feature_size
        u_in = uv[..., 0] * (aug.input_width - 1) / (w_f - 1)
        v_in = uv[..., 1] * (aug.input_height - 1) / (h_f - 1)
    return input_px_to_image_px(camera, u_in, v_in)


def project_cam_to_image(camera: Camera, points_cam: FloatArray) -> tuple[FloatArray, BoolArray]:
    """Project camera-frame points to calibrated-image pixels through the lens model.

    Convention:
        points_cam: ``(..., 3)`` float64 metres, OpenCV camera frame.
        returns: ``uv_image_px`` ``(..., 2)`` float64 (NaN where invalid) and ``ok`` bool
        ``(...)``: in front of the camera and inside the lens's monotonic field of view.
    """
    points_cam = np.asarray(points_cam, dtype=np.float64)
    z = points_cam[..., 2]
    in_front = z > MIN_DEPTH_M
    safe_z = np.where(in_front, z, 1.0)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow only where distort_normalized masks it
        xy = points_cam[..., :2] / safe_z[..., None]
    xy_d, in_fov = distort_normalized(camera.distortion, xy)
    ok = in_front & in_fov
    with np.errstate(over="ignore", invalid="ignore"):  # extreme lenses: overflow on ~ok points or off the map
        u = camera.fx * xy_d[..., 0] + camera.cx
        v = camera.fy * xy_d[..., 1] + camera.cy
    uv = np.stack([u, v], axis=-1)
    uv = np.where(ok[..., None], uv, np.nan)
    return uv, ok


def project_bev_to_feature(rig: RigConfig, camera: Camera, points_bev: FloatArray) -> tuple[FloatArray, BoolArray]:
    """Project BEV-frame points to feature-map pixels of one camera.

    Convention:
        points_bev: ``(..., 3)`` float64 metres in the BEV frame (``bev.frame``: ego, x forward,
        y left, z up; or the named sensor's frame).
        returns: ``uv_feature_px`` ``(..., 2)`` float64 ``(u, v)`` (NaN where not projectable)
        and ``ok`` bool ``(...)`` (in front, inside the lens FOV; NOT yet tested against the
        feature-map bounds, see :func:`bevcompile.grid.ipm.inside_feature_map`).
    """
    points_cam = transform_points(cam_from_bev_matrix(rig, camera), points_bev)
    uv_image_px, ok = project_cam_to_image(camera, points_cam)
    return image_px_to_feature_px(rig, camera, uv_image_px), ok


def unproject_image_to_cam(camera: Camera, uv_image_px: FloatArray, depth_m: FloatArray | float) -> tuple[FloatArray, BoolArray]:
    """Lift calibrated-image pixels to camera-frame points at a depth along the optical axis.

    Convention:
        uv_image_px: ``(..., 2)`` float64 ``(u, v)``; depth_m: broadcastable to ``(...)``,
        metres along camera z (LSS depth). returns ``points_cam`` ``(..., 3)`` float64 and
        ``ok`` (False where the pixel has no valid preimage under the lens model).
    """
    uv = np.asarray(uv_image_px, dtype=np.float64)
    xy_d = np.stack([(uv[..., 0] - camera.cx) / camera.fx, (uv[..., 1] - camera.cy) / camera.fy], axis=-1)
    xy, ok = undistort_normalized(camera.distortion, xy_d)
    depth = np.asarray(depth_m, dtype=np.float64)
    depth_b = np.broadcast_to(depth, xy.shape[:-1])
    points_cam = np.stack([xy[..., 0] * depth_b, xy[..., 1] * depth_b, depth_b], axis=-1)
    return points_cam, ok


def unproject_feature_to_bev(
    rig: RigConfig, camera: Camera, uv_feature_px: FloatArray, depth_m: FloatArray | float
) -> tuple[FloatArray, BoolArray]:
    """Feature-map pixel + depth along the optical axis -> BEV-frame point (the LSS frustum lift).

    Convention:
        uv_feature_px: ``(..., 2)`` float64 ``(u, v)`` feature pixels; depth_m broadcastable
        to ``(...)`` metres along camera z. returns ``points_bev`` ``(..., 3)`` float64 metres
        in the BEV frame (NaN where invalid) and ``ok`` bool ``(...)``.
    """
    uv_image_px = feature_px_to_image_px(rig, camera, uv_feature_px)
    points_cam, ok = unproject_image_to_cam(camera, uv_image_px, depth_m)
    return transform_points(bev_from_cam_matrix(rig, camera), points_cam), ok


def intersect_feature_rays_with_plane(
    rig: RigConfig, camera: Camera, uv_feature_px: FloatArray, height_m: float
) -> tuple[FloatArray, BoolArray]:
    """Intersect the viewing rays of feature pixels with the BEV-frame plane ``z = height_m``.

    Convention:
        uv_feature_px: ``(..., 2)`` float64. returns ``points_bev`` ``(..., 3)`` float64
        metres (BEV frame) and ``ok``: False where the ray has no valid preimage, is parallel
        to the plane, or meets it behind the camera.
    """
    points_bev_unit, ok = unproject_feature_to_bev(rig, camera, uv_feature_px, 1.0)
    origin = bev_from_cam_matrix(rig, camera)[:3, 3]
    direction = points_bev_unit - origin
    dz = direction[..., 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        depth = (height_m - origin[2]) / dz
    ok = ok & np.isfinite(depth) & (depth > MIN_DEPTH_M)
    points = origin + direction * np.where(ok, depth, np.nan)[..., None]
    return points, ok
