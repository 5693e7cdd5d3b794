import numpy as np
import pytest

from engine.rope import RopeScaling, rope_inv_freq


def test_plain_and_linear():
    inv = rope_inv_freq(8, 10000.0)
    np.testing.assert_allclose(inv, 10000.0 ** (-np.arange(0, 8, 2) / 8), rtol=1e-6)
    np.testing.assert_allclose(rope_inv_freq(8, 10000.0, RopeScaling("linear", 4.0)), inv / 4, rtol=1e-6)
    np.testing.assert_allclose(rope_inv_freq(8, 10000.0, freq_factors=np.full(4, 2.0)), inv / 2, rtol=1e-6)


def test_llama3_scaling_matches_reference_formula():
    # Llama 3.1: factor 8, low 1, high 4, original 8192, theta 500000, head_dim 128
    s = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    inv = rope_inv_freq(128, 500000.0, s).astype(np.float64)
    base = 500000.0 ** (-np.arange(0, 128, 2) / 128)
    wavelen = 2 * np.pi / base
    assert inv[0] == pytest.approx(base[0], rel=1e-6)  # short wavelengths unchanged
    assert inv[-1] == pytest.approx(base[-1] / 8, rel=1e-6)  # long ones divided by the factor
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192 / 1)
    assert mid.any()
    assert np.all((inv[mid] <= base[mid] * (1 + 1e-6)) & (inv[mid] >= base[mid] / 8 * (1 - 1e-6)))


def test_unknown_scaling():
    with pytest.raises(ValueError, match="unsupported RoPE scaling"):
        rope_inv_freq(8, 1e4, RopeScaling("dynamic", 2.0))


def test_yarn_attention_factor_and_ramp():
    from engine.rope import RopeScaling, rope_attention_factor, rope_inv_freq

    plain = rope_inv_freq(64, 10000.0)
    yarn = RopeScaling("yarn", 8.0, original_max_position=4096)
    inv = rope_inv_freq(64, 10000.0, yarn)
    # fast-turning dims (beta_fast = 32 turns over 4096 positions) keep their frequency, slow ones are
    # divided by the factor, the ramp between is monotone
    np.testing.assert_allclose(inv[:4], plain[:4], rtol=1e-6)
    np.testing.assert_allclose(inv[-4:], plain[-4:] / 8.0, rtol=1e-6)
    ratio = inv / plain
    assert np.all(np.diff(ratio) <= 1e-7)
    assert abs(rope_attention_factor(yarn) - (0.1 * np.log(8.0) + 1)) < 1e-12
    # DeepSeek's form: mscale / mscale_all_dim (equal: 1); an explicit factor wins
    deepseek = RopeScaling("yarn", 40.0, original_max_position=4096, mscale=1.0, mscale_all_dim=1.0)
    assert rope_attention_factor(deepseek) == 1.0
    assert rope_attention_factor(RopeScaling("yarn", 4.0, attention_factor=1.5)) == 1.5
    assert rope_attention_factor(RopeScaling("linear", 4.0)) == 1.0


def test_longrope_picks_its_factors_by_context():
    from engine.rope import rope_attention_factor

    s = RopeScaling("longrope", 4.0, original_max_position=64, short_factor=(1, 2), long_factor=(4, 8))
    base = rope_inv_freq(4, 1e4)
    np.testing.assert_allclose(rope_inv_freq(4, 1e4, s, n_ctx=64), base / [1.0, 2.0], rtol=1e-6)
    np.testing.assert_allclose(rope_inv_freq(4, 1e4, s, n_ctx=65), base / [4.0, 8.0], rtol=1e-6)
    assert rope_attention_factor(s) == pytest.approx(np.sqrt(1 + np.log(4.0) / np.log(64)))
    with pytest.raises(ValueError, match="LongRoPE needs 4 factors"):
        rope_inv_freq(8, 1e4, s)
