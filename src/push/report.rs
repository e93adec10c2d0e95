//! The outcome of a push, and how `lockstep push` prints it.

use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct ServerReport {
    pub url: String,
    /// The overall checksum the server reported after the update (verified).
    pub checksum: String,
    /// Wall time of its `/end_weight_update` (building replacements + the swap).
    pub end_s: f64,
    /// Time its engine stood still for the swap, as the server measured it.
    pub commit_pause_s: Option<f64>,
    /// Where the server wrote the update: `shadow` (a copy swapped in) or `in_place`.
    pub mode: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct PushReport {
    pub weight_version: String,
    /// Tensors given to the push.
    pub tensors: usize,
    /// Tensors each server staged (more than `tensors` when quantized on the client).
    pub staged_tensors: usize,
    pub buckets: usize,
    /// Bytes of the tensors given.
    pub source_bytes: usize,
    /// Bytes of safetensors bodies each server received.
    pub wire_bytes_per_server: usize,
    /// From the first request to the last bucket acknowledged by every server.
    pub transfer_s: f64,
    /// Of it, the client's time preparing buckets (reading, quantizing when asked, hashing,
    /// serializing), each bucket's overlapped with the sends of the one before.
    pub prepare_s: f64,
    /// The end calls (all servers at once).
    pub commit_s: f64,
    pub total_s: f64,
    pub servers: Vec<ServerReport>,
}

impl PushReport {
    /// Bytes each server received per second of transfer.
    pub fn gb_per_s_per_server(&self) -> f64 {
        self.wire_bytes_per_server as f64 / self.transfer_s.max(1e-9) / 1e9
    }

    /// Bytes all servers received together per second of transfer.
    pub fn gb_per_s_total(&self) -> f64 {
        self.gb_per_s_per_server() * self.servers.len() as f64
    }

    pub fn render(&self) -> String {
        let mut out = format!(
            "pushed {} tensors ({:.3} GB source, {:.3} GB on the wire per server, {} buckets) to {} server(s) as version {}\n\
             transfer {:.3} s: {:.3} GB/s per server, {:.3} GB/s total (client preparing buckets {:.3} s of it); commit {:.3} s; total {:.3} s\n",
            self.tensors,
            self.source_bytes as f64 / 1e9,
            self.wire_bytes_per_server as f64 / 1e9,
            self.buckets,
            self.servers.len(),
            self.weight_version,
            self.transfer_s,
            self.gb_per_s_per_server(),
            self.gb_per_s_total(),
            self.prepare_s,
            self.commit_s,
            self.total_s,
        );
        for s in &self.servers {
            let pause = s
                .commit_pause_s
                .map_or("?".to_string(), |p| format!("{:.1} ms", p * 1e3));
            let mode = s.mode.as_deref().unwrap_or("?");
            out.push_str(&format!(
                "  {}: checksum {} verified, end {:.3} s, written {mode}, generation paused {pause}\n",
                s.url, s.checksum, s.end_s
            ));
        }
        out
    }
}
