//! lockstep: MoE serving for RL rollouts and a trainer that share one low-precision contract.
//!
//! The map of the modules is shared/ARCHITECTURE.md; the contract is [`quant`].

pub mod backend;
pub mod bench;
pub mod checkpoint;
pub mod convert;
pub mod engine;
pub mod kv;
pub mod model;
pub mod push;
pub mod quant;
pub mod quantize;
pub mod sampling;
pub mod scheduler;
pub mod serve;
pub mod server;
pub mod tokenizer;
pub mod train;

/// Support for the test suites (not part of the API).
#[doc(hidden)]
pub mod testing {
    use std::io::Write;

    /// A test that cannot run here (an asset that was not fetched) says so: on stderr, and in
    /// the file `$LOCKSTEP_SKIP_LOG` names, which scripts/test.sh prints after the run, so a
    /// skip is never silent behind a passing test.
    pub fn skip(test: &str, why: &str) {
        let line = format!("SKIPPED {test}: {why}");
        eprintln!("{line}");
        if let Some(path) = std::env::var_os("LOCKSTEP_SKIP_LOG") {
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
            {
                let _ = writeln!(f, "{line}");
            }
        }
    }

    /// A random test's seed: `$LOCKSTEP_TEST_SEED` replays one, otherwise a fresh one from the
    /// clock and the process id. The caller prints it.
    pub fn test_seed() -> u64 {
        std::env::var("LOCKSTEP_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
                    ^ (std::process::id() as u64) << 32
            })
    }
}
