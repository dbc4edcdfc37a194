//! The SwiGLU MLP: dense layers' `mlp` and the MoE layers' `shared_experts`. transformers
//! `GlmMoeDsaMLP`: `down(silu(gate(x)) · up(x))`.

use candle_core::{Result, Tensor};

use super::capture::{emit, Capture};
use super::linear::Linear;
use super::names::SwiGluPaths;
use super::source::{Params, WeightSource};
use super::ModelError;
use crate::arch::glm_dsa::Role;

#[derive(Debug, Clone)]
pub struct Mlp {
    /// `[inter, hidden]`
    pub gate: Linear,
    /// `[inter, hidden]`
    pub up: Linear,
    /// `[hidden, inter]`
    pub down: Linear,
    pub(crate) paths: SwiGluPaths,
}

impl Mlp {
    /// A SwiGLU MLP of layer `l` from its three parameters' roles; per rank, gate and up are
    /// column-parallel and down row-parallel (`inter / tp`).
    pub(crate) fn new<S: WeightSource + ?Sized>(
        [gate, up, down]: [Role; 3],
        l: usize,
        vb: &mut Params<S>,
        paths: SwiGluPaths,
    ) -> std::result::Result<Self, ModelError> {
        let li = Some(l);
        Ok(Mlp {
            gate: vb.linear(gate, li)?,
            up: vb.linear(up, li)?,
            down: vb.linear(down, li)?,
            paths,
        })
    }

    /// `[T, hidden]` → `[T, hidden]`. Captures in transformers' hook order: gate_proj, act_fn,
    /// up_proj, down_proj, then the module.
    pub fn forward(&self, x: &Tensor, capture: &mut dyn Capture) -> Result<Tensor> {
        let p = &self.paths;
        let g = self.gate.forward(x)?;
        emit(capture, &p.gate, &g)?;
        let a = g.silu()?;
        emit(capture, &p.act, &a)?;
        let u = self.up.forward(x)?;
        emit(capture, &p.up, &u)?;
        let y = self.down.forward(&(a * u)?)?;
        emit(capture, &p.down, &y)?;
        emit(capture, &p.module, &y)?;
        Ok(y)
    }
}
