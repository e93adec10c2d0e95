//! The step plan: a [`ForwardBatch`] turned once into what every backend op reads (token rows,
//! each row's sequence and position, the rows that get logits).

use super::ForwardBatch;
use crate::backend::{SeqPlan, StepPlan};

/// The plan of `batch`.
pub fn plan<'a>(batch: &ForwardBatch<'a>) -> StepPlan<'a> {
    let mut p = StepPlan::default();
    for (i, s) in batch.seqs.iter().enumerate() {
        let len = s.tokens.len();
        let from = s.logits_from.unwrap_or(len).min(len);
        let first_row = p.tokens.len();
        p.seqs.push(SeqPlan {
            block_table: s.block_table,
            start_pos: s.start_pos,
            len,
            first_row,
            logits_from: from,
        });
        p.tokens.extend_from_slice(s.tokens);
        p.row_seq.extend(std::iter::repeat_n(i, len));
        p.row_pos.extend(s.start_pos..s.start_pos + len);
        p.logit_rows.extend(first_row + from..first_row + len);
    }
    p
}
