//! Prepared slots of an in-place weight update that wait for the commit on disk instead of in
//! resident memory (`--max-prepared-weight-bytes`): each slot in checkpoint layout (what
//! `/weights_checksum` hashes, what a converted checkpoint holds), appended to one unlinked file
//! (gone with the session, whatever ends it), read back layer by layer during the commit's
//! pause. Host memory then holds a layer of the update at a time, not all of it; the file's
//! pages sit in the page cache, which the kernel may drop.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::tensor::Dtype;

use crate::checkpoint::CheckpointPart;
use crate::model::checksum::WeightsChecksum;

/// One checkpoint tensor of a spilled slot: its bytes at `offset` of the file.
#[derive(Clone, Debug)]
pub struct SpilledPart {
    /// The checkpoint tensor name (`module.suffix`).
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    offset: u64,
    pub len: usize,
}

pub struct Spill {
    file: std::fs::File,
    len: u64,
    /// By the checkpoint name the slot arrived under (as a session's prepared slots).
    slots: BTreeMap<String, Vec<SpilledPart>>,
    /// The checkpoint tensors of every spilled slot, hashed as they were written.
    checksum: WeightsChecksum,
}

impl Spill {
    /// An empty spill file in `dir`, unlinked at once.
    pub fn create(dir: &Path) -> std::io::Result<Spill> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = dir.join(format!(
            "lockstep-weight-spill-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        std::fs::remove_file(&path)?;
        Ok(Spill {
            file,
            len: 0,
            slots: BTreeMap::new(),
            checksum: WeightsChecksum::default(),
        })
    }

    /// Appends a slot given as its checkpoint parts (of module `module`) under `name`,
    /// replacing an earlier one of that name.
    pub fn write_parts(
        &mut self,
        name: String,
        module: &str,
        parts: &[CheckpointPart<'_>],
    ) -> std::io::Result<()> {
        self.write_slots(vec![(name, module, parts)])
    }

    /// Appends slots, each `(name, module, parts)` as [`Spill::write_parts`] takes one, in
    /// order (a later slot of a name replaces an earlier one). The parts' places in the file
    /// are set first; then they are written at them and hashed on every core at once (a
    /// bucket is hundreds of megabytes: one thread copying it into the page cache was the
    /// bound).
    pub fn write_slots(
        &mut self,
        slots: Vec<(String, &str, &[CheckpointPart<'_>])>,
    ) -> std::io::Result<()> {
        use rayon::prelude::*;
        let mut placed: Vec<(Vec<SpilledPart>, String)> = Vec::with_capacity(slots.len());
        let mut writes = Vec::new();
        for (name, module, parts) in slots {
            self.remove(&name);
            let mut spilled = Vec::with_capacity(parts.len());
            for p in parts {
                spilled.push(SpilledPart {
                    name: format!("{module}.{}", p.suffix),
                    dtype: p.dtype,
                    shape: p.shape.clone(),
                    offset: self.len,
                    len: p.data.len(),
                });
                writes.push((self.len, &p.data[..]));
                self.len += p.data.len() as u64;
            }
            placed.push((spilled, name));
        }
        let hashes: Vec<u64> = writes
            .into_par_iter()
            .map(|(offset, data)| {
                self.file.write_all_at(data, offset)?;
                Ok(xxhash_rust::xxh3::xxh3_64(data))
            })
            .collect::<std::io::Result<_>>()?;
        let mut hashes = hashes.into_iter();
        for (spilled, name) in placed {
            for p in &spilled {
                let hash = hashes.next().expect("one hash per part written");
                self.checksum.tensors.insert(p.name.clone(), hash);
            }
            self.slots.insert(name, spilled);
        }
        Ok(())
    }

    /// Forgets the slot that arrived as `name` (sent again); its bytes stay in the file,
    /// unread.
    pub fn remove(&mut self, name: &str) -> bool {
        let Some(parts) = self.slots.remove(name) else {
            return false;
        };
        for p in parts {
            self.checksum.tensors.remove(&p.name);
        }
        true
    }

    /// Slots spilled.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// The names the spilled slots arrived under.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.slots.keys()
    }

    /// Bytes of the spilled slots.
    pub fn bytes(&self) -> usize {
        self.slots.values().flatten().map(|p| p.len).sum()
    }

    /// The checksum entries of every spilled slot.
    pub fn checksum(&self) -> &WeightsChecksum {
        &self.checksum
    }

    /// The spilled parts by layer (`model.layers.N.`; everything else as one group): a group
    /// holds whole slots and both halves of any gate/up pair.
    pub fn groups(&self) -> Vec<Vec<SpilledPart>> {
        let mut by: BTreeMap<Option<usize>, Vec<SpilledPart>> = BTreeMap::new();
        for parts in self.slots.values() {
            for p in parts {
                by.entry(layer_of(&p.name)).or_default().push(p.clone());
            }
        }
        by.into_values().collect()
    }

    /// A part's bytes, read back.
    pub fn read(&self, p: &SpilledPart) -> std::io::Result<Vec<u8>> {
        let mut buf = vec![0u8; p.len];
        self.read_into(p, 0, &mut buf)?;
        Ok(buf)
    }

    /// A part's bytes `at..at + buf.len()`, read back into `buf`.
    pub fn read_into(&self, p: &SpilledPart, at: usize, buf: &mut [u8]) -> std::io::Result<()> {
        if at + buf.len() > p.len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "bytes {at}..{} of `{}`, which has {}",
                    at + buf.len(),
                    p.name,
                    p.len
                ),
            ));
        }
        self.read_laid_out(&[(p, 0)], at, buf)
    }

    /// Bytes `at..at + buf.len()` of a buffer that holds each part of `layout` at its start
    /// (in increasing order, not overlapping), read into `buf`; bytes between parts are left
    /// as they were. Read in pieces of a few MiB on several threads at once: the file's pages
    /// are usually still in the page cache, where one thread's copy is the bound, and a layer's
    /// parts are often smaller than a piece.
    pub fn read_laid_out(
        &self,
        layout: &[(&SpilledPart, usize)],
        at: usize,
        buf: &mut [u8],
    ) -> std::io::Result<()> {
        use rayon::prelude::*;
        const PIECE: usize = 2 << 20;
        let end = at + buf.len();
        // (file offset, range of `buf`) of every piece of every part inside at..end.
        let mut pieces = Vec::new();
        for &(p, start) in layout {
            let (mut x, hi) = (start.max(at), (start + p.len).min(end));
            while x < hi {
                let n = (hi - x).min(PIECE);
                pieces.push((p.offset + (x - start) as u64, x - at, n));
                x += n;
            }
        }
        let mut slices = Vec::with_capacity(pieces.len());
        let (mut rest, mut taken) = (buf, 0);
        for (offset, from, n) in pieces {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(from - taken);
            let (piece, tail) = tail.split_at_mut(n);
            slices.push((offset, piece));
            (rest, taken) = (tail, from + n);
        }
        slices
            .into_par_iter()
            .try_for_each(|(offset, piece)| self.file.read_exact_at(piece, offset))
    }

    /// The checksum entry of a spilled part, as hashed when it was written.
    pub fn hash_of(&self, p: &SpilledPart) -> Option<u64> {
        self.checksum.tensors.get(&p.name).copied()
    }
}

/// N of `model.layers.N.…`.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::slots::Replacement;

    /// Slots come back byte for byte, grouped by layer, with their checksum entries; a slot
    /// sent again replaces the earlier one (entries and all).
    #[test]
    fn spilled_slots_read_back_by_layer() {
        let dir = tempfile::tempdir().unwrap();
        let mut spill = Spill::create(dir.path()).unwrap();
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "unlinked at once"
        );
        let v = |n: usize, x: f32| Replacement::Vector((0..n).map(|i| x + i as f32).collect());
        let names = [
            "model.layers.0.input_layernorm",
            "model.layers.10.input_layernorm",
            "model.layers.0.post_attention_layernorm",
            "model.norm",
        ];
        fn slot<'a>(m: &str, r: &'a Replacement) -> (String, Vec<CheckpointPart<'a>>) {
            (format!("{m}.weight"), r.checkpoint_parts(8))
        }
        let batch = |spill: &mut Spill, slots: &[(&str, (String, Vec<CheckpointPart<'_>>))]| {
            let slots = slots
                .iter()
                .map(|(m, (name, parts))| (name.clone(), *m, &parts[..]))
                .collect();
            spill.write_slots(slots).unwrap();
        };
        let first: Vec<Replacement> = (0..3).map(|i| v(4 + i, i as f32)).collect();
        let slots: Vec<_> = (0..3)
            .map(|i| (names[i], slot(names[i], &first[i])))
            .collect();
        batch(&mut spill, &slots);
        // Sent again, in a later batch or later in the same one: the new values replace the old.
        let (stale, last, again) = (v(7, 100.0), v(7, 3.0), v(5, 9.0));
        let slots = [
            (names[3], slot(names[3], &stale)),
            (names[1], slot(names[1], &again)),
            (names[3], slot(names[3], &last)),
        ];
        batch(&mut spill, &slots);
        assert_eq!(spill.slots(), 4);
        let groups = spill.groups();
        let layout: Vec<Vec<&str>> = groups
            .iter()
            .map(|g| g.iter().map(|p| p.name.as_str()).collect())
            .collect();
        assert_eq!(
            layout,
            [
                vec!["model.norm.weight"],
                vec![
                    "model.layers.0.input_layernorm.weight",
                    "model.layers.0.post_attention_layernorm.weight"
                ],
                vec!["model.layers.10.input_layernorm.weight"],
            ]
        );
        let mut want = WeightsChecksum::default();
        for (i, m) in names.iter().enumerate() {
            let r = if i == 1 {
                v(5, 9.0)
            } else {
                v(4 + i, i as f32)
            };
            want.insert_parts(m, &r.checkpoint_parts(8));
            let part = groups
                .iter()
                .flatten()
                .find(|p| p.name == format!("{m}.weight"))
                .unwrap();
            assert_eq!(
                spill.read(part).unwrap(),
                r.checkpoint_parts(8)[0].data.to_vec(),
                "{m}"
            );
        }
        assert_eq!(spill.checksum(), &want);
        assert!(spill.remove("model.norm.weight"));
        assert!(!spill.checksum().tensors.contains_key("model.norm.weight"));
        assert_eq!(spill.slots(), 3);
    }

    /// Any range of a part comes back as written, across the pieces it is read in; a range
    /// past the part's end is refused.
    #[test]
    fn ranges_of_a_part_read_back_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let mut spill = Spill::create(dir.path()).unwrap();
        // Something before it, so the part does not start at the file's beginning.
        spill
            .write_parts(
                "a.weight".into(),
                "a",
                &[CheckpointPart::bytes(
                    "weight",
                    Dtype::U8,
                    vec![3],
                    &[1, 2, 3],
                )],
            )
            .unwrap();
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let bytes: Vec<u8> = (0..(17 << 20) + 13)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        let n = bytes.len();
        spill
            .write_parts(
                "b.weight".into(),
                "b",
                &[CheckpointPart::bytes("weight", Dtype::U8, vec![n], &bytes)],
            )
            .unwrap();
        let part = spill
            .groups()
            .into_iter()
            .flatten()
            .find(|p| p.name == "b.weight")
            .unwrap();
        assert_eq!(part.len, n);
        assert_eq!(spill.read(&part).unwrap(), bytes);
        for (at, len) in [
            (0, 1),
            (5, (8 << 20) + 1),
            ((8 << 20) - 3, 9 << 20),
            (n - 7, 7),
        ] {
            let mut buf = vec![0u8; len];
            spill.read_into(&part, at, &mut buf).unwrap();
            assert!(buf == bytes[at..at + len], "bytes {at}..{}", at + len);
        }
        let mut buf = vec![0u8; 8];
        let e = spill.read_into(&part, n - 7, &mut buf).unwrap_err();
        assert!(e.to_string().contains("b.weight"), "{e}");

        // Both parts laid out with a gap, read in chunks that cut through parts and gaps:
        // every part's bytes at its start, the gaps untouched.
        let a = spill
            .groups()
            .into_iter()
            .flatten()
            .find(|p| p.name == "a.weight")
            .unwrap();
        let layout = [(&a, 5), (&part, 300)];
        let total = 300 + n + 11;
        let mut want = vec![0xEEu8; total];
        want[5..8].copy_from_slice(&[1, 2, 3]);
        want[300..300 + n].copy_from_slice(&bytes);
        for chunk in [7, 4 << 20, (3 << 20) + 5, total] {
            let mut got = vec![0xEEu8; total];
            for (i, c) in got.chunks_mut(chunk).enumerate() {
                spill.read_laid_out(&layout, i * chunk, c).unwrap();
            }
            assert!(got == want, "read in chunks of {chunk}");
        }
    }
}
