//! The two-layer MLP of examples/c/mlp_model.h, operation for operation in
//! the same order, so that the Rust and C examples print the same losses.
// Index loops as in the C header: the same operations in the same order.
#![allow(clippy::needless_range_loop)]
pub const IN: usize = 16;
pub const HIDDEN: usize = 33;
pub const OUT: usize = 5;

/// Parameters in registration order, with their shapes and names.
pub const W1: usize = 0;
pub const B1: usize = 1;
pub const W2: usize = 2;
pub const B2: usize = 3;
pub const NPARAMS: usize = 4;
pub const SHAPES: [&[i64]; NPARAMS] = [
    &[HIDDEN as i64, IN as i64],
    &[HIDDEN as i64],
    &[OUT as i64, HIDDEN as i64],
    &[OUT as i64],
];
pub const NAMES: [&str; NPARAMS] = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"];

pub fn numel(p: usize) -> usize {
    SHAPES[p].iter().product::<i64>() as usize
}

/// Deterministic value in [-1, 1) from a counter (splitmix64).
pub fn noise(mut x: u64) -> f32 {
    x = x.wrapping_add(0x9e3779b97f4a7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
    x ^= x >> 31;
    ((x >> 11) as f64 * (1.0 / (1u64 << 52) as f64) - 1.0) as f32
}

/// Sample `index` of step `step`: input x and the teacher's target y.
pub fn sample(step: i32, index: i32, x: &mut [f32], y: &mut [f32]) {
    for (k, xk) in x.iter_mut().enumerate().take(IN) {
        *xk = noise(((step as u64) << 32) ^ ((index as u64) << 8) ^ k as u64);
    }
    for (j, yj) in y.iter_mut().enumerate().take(OUT) {
        let mut s = 0.0f32;
        for k in 0..IN {
            s += noise(0xabcd + (j * IN + k) as u64) * x[k];
        }
        *yj = s.sin();
    }
}

/// Scratch for `count` samples (row-major, as in the C header).
pub struct Scratch {
    pub xs: Vec<f32>,
    pub ys: Vec<f32>,
    pub hs: Vec<f32>,
    pub douts: Vec<f32>,
    pub dhs: Vec<f32>,
}

impl Scratch {
    pub fn new(count: usize) -> Self {
        Scratch {
            xs: vec![0.0; count * IN],
            ys: vec![0.0; count * OUT],
            hs: vec![0.0; count * HIDDEN],
            douts: vec![0.0; count * OUT],
            dhs: vec![0.0; count * HIDDEN],
        }
    }
}

/// Forward 1 (needs fc1): samples [first, first + count) into xs, ys, hs.
pub fn forward1(w1: &[f32], b1: &[f32], step: i32, first: i32, count: usize, s: &mut Scratch) {
    for n in 0..count {
        let (x, y) = (
            &mut s.xs[n * IN..(n + 1) * IN],
            &mut s.ys[n * OUT..(n + 1) * OUT],
        );
        sample(step, first + n as i32, x, y);
        for i in 0..HIDDEN {
            let mut a = b1[i];
            for k in 0..IN {
                a += w1[i * IN + k] * x[k];
            }
            s.hs[n * HIDDEN + i] = if a > 0.0 { a } else { 0.0 };
        }
    }
}

/// Forward 2 (needs fc2): the mean squared error; douts = d(loss)/d(out) * grad_scale.
pub fn forward2(w2: &[f32], b2: &[f32], count: usize, grad_scale: f32, s: &mut Scratch) -> f32 {
    let mut loss = 0.0f32;
    let norm = 1.0f32 / (count * OUT) as f32;
    for n in 0..count {
        for j in 0..OUT {
            let mut a = b2[j];
            for i in 0..HIDDEN {
                a += w2[j * HIDDEN + i] * s.hs[n * HIDDEN + i];
            }
            let d = a - s.ys[n * OUT + j];
            loss += d * d * norm;
            s.douts[n * OUT + j] = 2.0f32 * d * norm * grad_scale;
        }
    }
    loss
}

/// Backward 2 (needs fc2): fc2's gradients and dhs.
pub fn backward2(w2: &[f32], count: usize, s: &mut Scratch, gw2: &mut [f32], gb2: &mut [f32]) {
    gw2.fill(0.0);
    gb2.fill(0.0);
    for n in 0..count {
        let dh = &mut s.dhs[n * HIDDEN..(n + 1) * HIDDEN];
        dh.fill(0.0);
        for j in 0..OUT {
            let dout = s.douts[n * OUT + j];
            gb2[j] += dout;
            for i in 0..HIDDEN {
                gw2[j * HIDDEN + i] += dout * s.hs[n * HIDDEN + i];
                dh[i] += dout * w2[j * HIDDEN + i];
            }
        }
    }
}

/// Backward 1 (needs no params): fc1's gradients from xs, hs and dhs.
pub fn backward1(count: usize, s: &Scratch, gw1: &mut [f32], gb1: &mut [f32]) {
    gw1.fill(0.0);
    gb1.fill(0.0);
    for n in 0..count {
        for i in 0..HIDDEN {
            if s.hs[n * HIDDEN + i] <= 0.0 {
                continue;
            }
            let dh = s.dhs[n * HIDDEN + i];
            gb1[i] += dh;
            for k in 0..IN {
                gw1[i * IN + k] += dh * s.xs[n * IN + k];
            }
        }
    }
}
