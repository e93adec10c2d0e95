//! [`Backend`] on the CPU: each op is the reference arithmetic (plain Rust + rayon, f32
//! accumulation in a fixed order), activations are `Vec<f32>` sized by the op that writes them,
//! and sampling runs `sampling::sample` on the host logits.

use super::attention::{paged_attention, AttentionSeq, KvMemory};
use super::linear::DenseWeight;
use super::ops;
use crate::backend::step::{Backend, Buffers, Dims, Logits, MoeShape, StepPlan};
use crate::backend::trace::{ExpertTrace, MoeTrace, SwiGluTrace};
use crate::backend::Linear;
use crate::sampling::{self, SampleInput, SamplerScratch};

/// A SwiGLU MLP or expert: `down(silu(gate(x)) * up(x))`.
#[derive(Clone)]
pub struct SwiGlu {
    pub gate: Box<dyn Linear>,
    pub up: Box<dyn Linear>,
    pub down: Box<dyn Linear>,
}

/// The CPU backend: its only state is the sampler's scratch.
#[derive(Default)]
pub struct Cpu {
    scratch: SamplerScratch,
}

/// An MoE layer's routing on the CPU. Grouped buffers hold expert `e`'s rows at
/// `offsets[e]..offsets[e + 1]`, in the order of `members[e]`.
#[derive(Default)]
pub struct CpuRoute {
    /// Router softmax, `[rows, experts]`.
    probs: Vec<f32>,
    /// Per `row * top_k + slot`: the expert and its combine weight.
    choice: Vec<(usize, f32)>,
    /// Per expert: the `row * top_k + slot` entries routed to it, ascending.
    members: Vec<Vec<usize>>,
    offsets: Vec<usize>,
    /// Per `row * top_k + slot`: its row within its expert's group.
    row_in_expert: Vec<usize>,
    top_k: usize,
    inter: usize,
    /// Per kept MoE layer: its experts, `[rows, top_k]`.
    kept: Vec<Vec<i32>>,
}

impl CpuRoute {
    fn pairs(&self) -> usize {
        self.choice.len()
    }
}

/// `out` resized to `len` (its old values are overwritten by the op).
fn sized(out: &mut Vec<f32>, len: usize) -> &mut [f32] {
    out.resize(len, 0.0);
    &mut out[..len]
}

impl Backend for Cpu {
    type Error = std::convert::Infallible;
    type Act = Vec<f32>;
    type Vector = Vec<f32>;
    type Table = DenseWeight;
    type Linear = Box<dyn Linear>;
    type LmHead = Box<dyn Linear>;
    type SwiGlu = SwiGlu;
    type Experts = Vec<SwiGlu>;
    type Kv = KvMemory;
    type Route = CpuRoute;

    fn begin(
        &mut self,
        _plan: &StepPlan<'_>,
        _dims: &Dims,
        _keep: bool,
    ) -> Result<(), Self::Error> {
        Ok(())
    }

    fn embed(
        &mut self,
        table: &DenseWeight,
        plan: &StepPlan<'_>,
        dims: &Dims,
        out: &mut Vec<f32>,
    ) -> Result<(), Self::Error> {
        let h = dims.hidden;
        let x = sized(out, plan.rows() * h);
        for (row, &t) in x.chunks_mut(h).zip(&plan.tokens) {
            let t = t as usize;
            match table {
                DenseWeight::F32(w) => row.copy_from_slice(&w[t * h..][..h]),
                DenseWeight::Bf16(w) => row
                    .iter_mut()
                    .zip(&w[t * h..][..h])
                    .for_each(|(d, s)| *d = s.to_f32()),
            }
        }
        Ok(())
    }

    fn rms_norm(
        &mut self,
        x: &mut Vec<f32>,
        residual: Option<&Vec<f32>>,
        w: &Vec<f32>,
        out: &mut Vec<f32>,
        rows: usize,
        width: usize,
        eps: f32,
    ) -> Result<(), Self::Error> {
        let n = rows * width;
        if let Some(r) = residual {
            ops::add_inplace(&mut x[..n], &r[..n]);
        }
        ops::rms_norm(&x[..n], w, eps, sized(out, n));
        Ok(())
    }

    fn linear(
        &mut self,
        w: &Box<dyn Linear>,
        x: &Vec<f32>,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), Self::Error> {
        let x = &x[..rows * w.in_features()];
        w.forward(x, rows, sized(out, rows * w.out_features()));
        Ok(())
    }

    fn qk_norm_rope_store(
        &mut self,
        layer: usize,
        norms: Option<(&Vec<f32>, &Vec<f32>)>,
        inv_freq: &Vec<f32>,
        q: &mut Vec<f32>,
        k: &mut Vec<f32>,
        v: &Vec<f32>,
        kv: &mut KvMemory,
        plan: &StepPlan<'_>,
        dims: &Dims,
    ) -> Result<(), Self::Error> {
        let (n, qs, ks, hd) = (plan.rows(), dims.q_size(), dims.kv_size(), dims.head_dim);
        if let Some((qn, kn)) = norms {
            ops::head_rms_norm_inplace(&mut q[..n * qs], qn, dims.eps);
            ops::head_rms_norm_inplace(&mut k[..n * ks], kn, dims.eps);
        }
        for (r, (&s, &pos)) in plan.row_seq.iter().zip(&plan.row_pos).enumerate() {
            ops::apply_rope(&mut q[r * qs..][..qs], hd, pos, inv_freq);
            ops::apply_rope(&mut k[r * ks..][..ks], hd, pos, inv_freq);
            kv.write(
                layer,
                plan.seqs[s].block_table,
                pos,
                &k[r * ks..][..ks],
                &v[r * ks..][..ks],
            );
        }
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        q: &Vec<f32>,
        kv: &KvMemory,
        plan: &StepPlan<'_>,
        dims: &Dims,
        out: &mut Vec<f32>,
    ) -> Result<(), Self::Error> {
        let seqs: Vec<AttentionSeq<'_>> = plan
            .seqs
            .iter()
            .map(|s| AttentionSeq {
                block_table: s.block_table,
                start_pos: s.start_pos,
                len: s.len,
            })
            .collect();
        let n = plan.rows() * dims.q_size();
        paged_attention(kv, layer, &seqs, &q[..n], dims.heads, sized(out, n));
        Ok(())
    }

    fn mlp_gate_up(
        &mut self,
        w: &SwiGlu,
        x: &Vec<f32>,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), Self::Error> {
        // `[gate rows | up rows]`.
        let inter = w.gate.out_features();
        let x = &x[..rows * w.gate.in_features()];
        let (g, u) = sized(out, 2 * rows * inter).split_at_mut(rows * inter);
        w.gate.forward(x, rows, g);
        w.up.forward(x, rows, u);
        Ok(())
    }

    fn mlp_down(
        &mut self,
        w: &SwiGlu,
        act: &Vec<f32>,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), Self::Error> {
        self.linear(&w.down, act, rows, out)
    }

    fn silu_mul(
        &mut self,
        gate_up: &Vec<f32>,
        rows: usize,
        inter: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), Self::Error> {
        let n = rows * inter;
        ops::silu_mul(&gate_up[..n], &gate_up[n..2 * n], sized(out, n));
        Ok(())
    }

    fn moe_route(
        &mut self,
        logits: &Vec<f32>,
        rows: usize,
        shape: MoeShape,
        replay: Option<&[i32]>,
        moe_index: usize,
        route: &mut CpuRoute,
    ) -> Result<(), Self::Error> {
        let (e, top_k) = (shape.experts, shape.top_k);
        route.probs.clear();
        route.probs.extend_from_slice(&logits[..rows * e]);
        route.choice.clear();
        route.choice.resize(rows * top_k, (0, 0.0));
        for r in 0..rows {
            let probs = &mut route.probs[r * e..][..e];
            ops::softmax_inplace(probs);
            let given = replay
                .map(|ids| &ids[r * top_k..][..top_k])
                .filter(|ids| ids.iter().all(|&i| i >= 0 && (i as usize) < e));
            let top = match given {
                Some(ids) => ids.iter().map(|&i| i as usize).collect(),
                None => ops::top_k(probs, top_k),
            };
            let sum: f32 = top.iter().map(|&i| probs[i]).sum();
            for (slot, &i) in top.iter().enumerate() {
                let w = if shape.renormalize {
                    probs[i] / sum
                } else {
                    probs[i]
                };
                route.choice[r * top_k + slot] = (i, w);
            }
        }
        route.top_k = top_k;
        route.inter = shape.inter;
        route.members = vec![Vec::new(); e];
        for (s, &(ex, _)) in route.choice.iter().enumerate() {
            route.members[ex].push(s);
        }
        route.offsets.clear();
        route.row_in_expert.clear();
        route.row_in_expert.resize(rows * top_k, 0);
        let mut row = 0;
        for m in &route.members {
            route.offsets.push(row);
            for (j, &s) in m.iter().enumerate() {
                route.row_in_expert[s] = j;
            }
            row += m.len();
        }
        route.offsets.push(row);
        route.kept.truncate(moe_index);
        let ids = route.choice.iter().map(|&(e, _)| e as i32).collect();
        route.kept.push(ids);
        Ok(())
    }

    fn experts_gate_up(
        &mut self,
        w: &Vec<SwiGlu>,
        x: &Vec<f32>,
        _rows: usize,
        route: &CpuRoute,
        out: &mut Vec<f32>,
    ) -> Result<(), Self::Error> {
        // `[gate rows | up rows]`, each grouped by expert.
        let (pairs, inter) = (route.pairs(), route.inter);
        let (g, u) = sized(out, 2 * pairs * inter).split_at_mut(pairs * inter);
        for (ex, members) in route.members.iter().enumerate() {
            if members.is_empty() {
                continue;
            }
            let hidden = w[ex].gate.in_features();
            let mut xin = Vec::with_capacity(members.len() * hidden);
            for &s in members {
                xin.extend_from_slice(&x[(s / route.top_k) * hidden..][..hidden]);
            }
            let rows = route.offsets[ex] * inter..route.offsets[ex + 1] * inter;
            w[ex]
                .gate
                .forward(&xin, members.len(), &mut g[rows.clone()]);
            w[ex].up.forward(&xin, members.len(), &mut u[rows]);
        }
        Ok(())
    }

    fn experts_down(
        &mut self,
        w: &Vec<SwiGlu>,
        act: &Vec<f32>,
        route: &CpuRoute,
        out: &mut Vec<f32>,
    ) -> Result<(), Self::Error> {
        let (pairs, inter) = (route.pairs(), route.inter);
        let Some(hidden) = w.first().map(|e| e.down.out_features()) else {
            return Ok(());
        };
        let out = sized(out, pairs * hidden);
        for (ex, members) in route.members.iter().enumerate() {
            if members.is_empty() {
                continue;
            }
            let (a, b) = (route.offsets[ex], route.offsets[ex + 1]);
            w[ex].down.forward(
                &act[a * inter..b * inter],
                members.len(),
                &mut out[a * hidden..b * hidden],
            );
        }
        Ok(())
    }

    fn moe_combine(
        &mut self,
        expert_out: &Vec<f32>,
        route: &CpuRoute,
        rows: usize,
        hidden: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), Self::Error> {
        let y = sized(out, rows * hidden);
        y.fill(0.0);
        for (r, yr) in y.chunks_mut(hidden).enumerate() {
            for slot in 0..route.top_k {
                let s = r * route.top_k + slot;
                let (ex, w) = route.choice[s];
                let row = route.offsets[ex] + route.row_in_expert[s];
                for (a, b) in yr.iter_mut().zip(&expert_out[row * hidden..][..hidden]) {
                    *a += w * b;
                }
            }
        }
        Ok(())
    }

    fn routed_experts(
        &mut self,
        route: &CpuRoute,
        rows: usize,
        moe_layers: usize,
        top_k: usize,
    ) -> Result<Vec<i32>, Self::Error> {
        let mut out = vec![0i32; rows * moe_layers * top_k];
        for (m, ids) in route.kept.iter().take(moe_layers).enumerate() {
            for t in 0..rows {
                out[(t * moe_layers + m) * top_k..][..top_k]
                    .copy_from_slice(&ids[t * top_k..][..top_k]);
            }
        }
        Ok(out)
    }

    fn logits(
        &mut self,
        bufs: &mut Buffers<Vec<f32>>,
        add_y: bool,
        norm: &Vec<f32>,
        head: &Box<dyn Linear>,
        _table: &DenseWeight,
        plan: &StepPlan<'_>,
        dims: &Dims,
        samples: &[Option<SampleInput<'_>>],
        trace: bool,
    ) -> Result<Logits, Self::Error> {
        let (h, v) = (dims.hidden, dims.vocab);
        let x = &mut bufs.x;
        if add_y {
            let n = plan.rows() * h;
            ops::add_inplace(&mut x[..n], &bufs.y[..n]);
        }
        let mut logit_rows = Vec::with_capacity(plan.seqs.len());
        let mut first = 0;
        for s in &plan.seqs {
            logit_rows.push((first, s.logit_count()));
            first += s.logit_count();
        }
        let rows = &plan.logit_rows;
        let mut hsel = vec![0f32; rows.len() * h];
        for (dst, &r) in hsel.chunks_mut(h).zip(rows) {
            ops::rms_norm_row(&x[r * h..][..h], norm, dims.eps, dst);
        }
        let mut logits = vec![0f32; rows.len() * v];
        head.forward(&hsel, rows.len(), &mut logits);
        let sampled = (0..plan.seqs.len())
            .map(|i| {
                let input = samples.get(i)?.as_ref()?;
                let (first, count) = logit_rows[i];
                if count == 0 {
                    return None;
                }
                let mut row = logits[(first + count - 1) * v..][..v].to_vec();
                Some(sampling::sample(&mut row, input, &mut self.scratch))
            })
            .collect();
        Ok(Logits {
            logits,
            logit_rows,
            sampled,
            lm_head_in: trace.then_some(hsel),
        })
    }

    fn host(&mut self, a: &Vec<f32>, len: usize) -> Result<Vec<f32>, Self::Error> {
        Ok(a[..len].to_vec())
    }

    fn kv_stored(
        &mut self,
        kv: &KvMemory,
        a: &Vec<f32>,
        len: usize,
    ) -> Result<Vec<f32>, Self::Error> {
        Ok(kv.stored(&a[..len]))
    }

    fn mlp_trace(
        &mut self,
        bufs: &Buffers<Vec<f32>>,
        rows: usize,
        inter: usize,
    ) -> Result<SwiGluTrace, Self::Error> {
        let (gate_up, act) = (&bufs.gate_up, &bufs.act);
        let n = rows * inter;
        Ok(SwiGluTrace {
            gate: gate_up[..n].to_vec(),
            up: gate_up[n..2 * n].to_vec(),
            act: act[..n].to_vec(),
        })
    }

    fn moe_trace(
        &mut self,
        route: &CpuRoute,
        bufs: &Buffers<Vec<f32>>,
        rows: usize,
        _shape: MoeShape,
    ) -> Result<MoeTrace, Self::Error> {
        let (gate_up, act, expert_out) = (&bufs.gate_up, &bufs.act, &bufs.expert_out);
        let (pairs, inter) = (route.pairs(), route.inter);
        let hidden = expert_out.len() / pairs.max(1);
        debug_assert_eq!(pairs, rows * route.top_k);
        let experts = route
            .members
            .iter()
            .enumerate()
            .map(|(ex, members)| {
                if members.is_empty() {
                    return None;
                }
                let (a, b) = (route.offsets[ex], route.offsets[ex + 1]);
                Some(ExpertTrace {
                    members: members.clone(),
                    swiglu: SwiGluTrace {
                        gate: gate_up[a * inter..b * inter].to_vec(),
                        up: gate_up[(pairs + a) * inter..(pairs + b) * inter].to_vec(),
                        act: act[a * inter..b * inter].to_vec(),
                    },
                    out: expert_out[a * hidden..b * hidden].to_vec(),
                })
            })
            .collect();
        Ok(MoeTrace {
            probs: route.probs.clone(),
            choice: route.choice.clone(),
            row_in_expert: route.row_in_expert.clone(),
            experts,
        })
    }
}
