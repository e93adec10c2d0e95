//! Safetensors checkpoints on disk: a reader over single or sharded files (memory-mapped, so
//! a tensor is read only when asked for) and a sharded writer with an index, used by
//! `convert`, `quantize` and the model loader.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorView, View};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a valid safetensors file: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    Index { path: PathBuf, reason: String },
    #[error("tensor `{0}` is not in the checkpoint")]
    Missing(String),
    #[error("tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One memory-mapped safetensors file, its header parsed once (a header of thousands of
/// tensors takes milliseconds to parse: per tensor read, that was seconds per checkpoint).
pub struct SafetensorsFile {
    pub path: PathBuf,
    /// The file's memory map, shared by every [`SafetensorsFile::shared`] slice.
    mmap: Bytes,
    /// Where the data starts (after the length prefix and the header), and the header.
    data_start: usize,
    metadata: Metadata,
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<SafetensorsFile, CheckpointError> {
        let file = File::open(path).map_err(io_err(path))?;
        // SAFETY: the file is opened read-only; checkpoints are not modified while we serve them.
        let mmap = Bytes::from_owner(unsafe { Mmap::map(&file) }.map_err(io_err(path))?);
        // Parsed and validated (every tensor's offsets within the file) once.
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| CheckpointError::Format {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            mmap,
            data_start: 8 + header_len,
            metadata,
        })
    }

    /// The file's tensor names, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = String> + '_ {
        self.metadata.offset_keys().into_iter()
    }

    /// One tensor, from the header parsed at open.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, CheckpointError> {
        let bad = |reason: String| CheckpointError::Tensor {
            name: name.to_string(),
            reason,
        };
        let info = self
            .metadata
            .info(name)
            .ok_or_else(|| CheckpointError::Missing(name.to_string()))?;
        let (start, end) = info.data_offsets;
        let data = self
            .mmap
            .get(self.data_start + start..self.data_start + end)
            .ok_or_else(|| bad("data offsets past the end of the file".into()))?;
        TensorView::new(info.dtype, info.shape.clone(), data).map_err(|e| bad(e.to_string()))
    }

    /// `data` (a tensor's bytes from [`SafetensorsFile::tensor`]) as bytes that share the
    /// file's map: no copy, and they may outlive the borrow. None for bytes of another file.
    pub fn shared(&self, data: &[u8]) -> Option<Bytes> {
        let map = self.mmap.as_ptr_range();
        let within = map.start <= data.as_ptr() && data.as_ptr_range().end <= map.end;
        within.then(|| self.mmap.slice_ref(data))
    }

    /// Drops the file's pages from this process's resident set (`MADV_DONTNEED`; they stay
    /// in the page cache, and a later read maps them again with the same bytes). A loader
    /// calls it after each layer, so loading holds one layer of the file, not all of it.
    pub fn release_pages(&self) {
        #[cfg(target_os = "linux")]
        if !self.mmap.is_empty() {
            // SAFETY: the range is this file's read-only shared mapping (page-aligned start,
            // as mmap returns it). Dropping its pages frees no memory anything points into:
            // every later read of the range faults the file's unchanged bytes back in.
            unsafe {
                libc::madvise(
                    self.mmap.as_ptr() as *mut libc::c_void,
                    self.mmap.len(),
                    libc::MADV_DONTNEED,
                )
            };
        }
    }

    pub fn view(&self) -> Result<SafeTensors<'_>, CheckpointError> {
        SafeTensors::deserialize(&self.mmap).map_err(|e| CheckpointError::Format {
            path: self.path.clone(),
            reason: e.to_string(),
        })
    }

    /// Metadata strings of the header (`__metadata__`), from the header parsed at open.
    pub fn metadata(&self) -> HashMap<String, String> {
        self.metadata.metadata().clone().unwrap_or_default()
    }
}

/// A Hugging Face checkpoint directory (or a single .safetensors file).
pub struct Checkpoint {
    pub dir: PathBuf,
    files: Vec<SafetensorsFile>,
    /// Tensor name -> index into `files`, sorted by name for deterministic iteration.
    index: BTreeMap<String, usize>,
}

impl Checkpoint {
    /// Opens `model.safetensors.index.json` shards, or every `*.safetensors` file in `path`,
    /// or `path` itself when it is a file.
    pub fn open(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let (dir, paths) = if path.is_file() {
            (
                path.parent().unwrap_or(Path::new(".")).to_path_buf(),
                vec![path.to_path_buf()],
            )
        } else {
            (path.to_path_buf(), shard_paths(path)?)
        };
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for p in paths {
            let f = SafetensorsFile::open(&p)?;
            for name in f.names() {
                if index.insert(name.clone(), files.len()).is_some() {
                    return Err(CheckpointError::Index {
                        path: p.clone(),
                        reason: format!("tensor `{name}` appears in two shards"),
                    });
                }
            }
            files.push(f);
        }
        Ok(Checkpoint { dir, files, index })
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, CheckpointError> {
        let &i = self
            .index
            .get(name)
            .ok_or_else(|| CheckpointError::Missing(name.to_string()))?;
        self.files[i].tensor(name)
    }

    /// [`SafetensorsFile::release_pages`] of every file.
    pub fn release_pages(&self) {
        self.files.iter().for_each(SafetensorsFile::release_pages);
    }

    /// A tensor's bytes (from [`Checkpoint::tensor`]) sharing its file's map; None for bytes
    /// that are not this checkpoint's.
    pub fn shared(&self, data: &[u8]) -> Option<Bytes> {
        self.files.iter().find_map(|f| f.shared(data))
    }

    /// `config.json` of the checkpoint directory, if present.
    pub fn config(&self) -> Result<Option<serde_json::Value>, CheckpointError> {
        read_json_if_exists(&self.dir.join("config.json"))
    }
}

pub fn read_json_if_exists(path: &Path) -> Result<Option<serde_json::Value>, CheckpointError> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| CheckpointError::Index {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
}

fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let index = dir.join("model.safetensors.index.json");
    if let Some(json) = read_json_if_exists(&index)? {
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| CheckpointError::Index {
                path: index.clone(),
                reason: "no `weight_map` object".into(),
            })?;
        let mut shards: Vec<PathBuf> = map
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| dir.join(f))
            .collect();
        shards.sort();
        shards.dedup();
        return Ok(shards);
    }
    // The HF single-file name wins over other .safetensors files lying beside it.
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let mut shards = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let p = entry.map_err(io_err(dir))?.path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            shards.push(p);
        }
    }
    if shards.is_empty() {
        return Err(CheckpointError::Index {
            path: dir.to_path_buf(),
            reason: "no .safetensors files".into(),
        });
    }
    shards.sort();
    Ok(shards)
}

/// Widens a BF16/F16/F32 tensor to f32 (exactly). Other dtypes are an error naming `name`.
pub fn to_f32(name: &str, t: &TensorView<'_>) -> Result<Vec<f32>, CheckpointError> {
    let bytes = t.data();
    Ok(match t.dtype() {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(CheckpointError::Tensor {
                name: name.to_string(),
                reason: format!("dtype {other:?} is not BF16, F16 or F32"),
            })
        }
    })
}

/// A tensor owned in memory, ready to be written.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl OwnedTensor {
    pub fn new(dtype: Dtype, shape: Vec<usize>, data: Vec<u8>) -> OwnedTensor {
        let n: usize = shape.iter().product();
        debug_assert_eq!(
            n * dtype.bitsize() / 8,
            data.len(),
            "tensor bytes match its shape"
        );
        OwnedTensor { dtype, shape, data }
    }

    pub fn f32(shape: Vec<usize>, values: &[f32]) -> OwnedTensor {
        OwnedTensor::new(
            Dtype::F32,
            shape,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
    }

    /// Rounds to BF16 (round-to-nearest-even).
    pub fn bf16(shape: Vec<usize>, values: &[f32]) -> OwnedTensor {
        OwnedTensor::new(
            Dtype::BF16,
            shape,
            values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
        )
    }

    pub fn from_view(t: &TensorView<'_>) -> OwnedTensor {
        OwnedTensor {
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            data: t.data().to_vec(),
        }
    }
}

impl View for &OwnedTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes one safetensors file (tensors sorted by name, as the format requires for stable output).
pub fn write_file(
    path: &Path,
    tensors: &BTreeMap<String, OwnedTensor>,
    metadata: Option<HashMap<String, String>>,
) -> Result<(), CheckpointError> {
    safetensors::tensor::serialize_to_file(tensors.iter(), metadata, path).map_err(|e| {
        CheckpointError::Format {
            path: path.to_path_buf(),
            reason: e.to_string(),
        }
    })
}

/// Writes tensors into `model-0000i-of-0000n.safetensors` shards of bounded size plus
/// `model.safetensors.index.json`, holding at most one shard in memory.
pub struct ShardedWriter {
    dir: PathBuf,
    max_shard_bytes: usize,
    pending: BTreeMap<String, OwnedTensor>,
    pending_bytes: usize,
    written: Vec<(PathBuf, Vec<String>)>,
    total_bytes: usize,
    metadata: HashMap<String, String>,
}

impl ShardedWriter {
    pub fn new(
        dir: &Path,
        max_shard_bytes: usize,
        metadata: HashMap<String, String>,
    ) -> ShardedWriter {
        ShardedWriter {
            dir: dir.to_path_buf(),
            max_shard_bytes,
            pending: BTreeMap::new(),
            pending_bytes: 0,
            written: Vec::new(),
            total_bytes: 0,
            metadata,
        }
    }

    pub fn add(&mut self, name: String, t: OwnedTensor) -> Result<(), CheckpointError> {
        if self.pending_bytes + t.data.len() > self.max_shard_bytes && !self.pending.is_empty() {
            self.flush()?;
        }
        self.pending_bytes += t.data.len();
        self.total_bytes += t.data.len();
        self.pending.insert(name, t);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), CheckpointError> {
        let path = self.dir.join(format!(
            "shard-{:05}.tmp.safetensors",
            self.written.len() + 1
        ));
        write_file(&path, &self.pending, Some(self.metadata.clone()))?;
        let names = std::mem::take(&mut self.pending).into_keys().collect();
        self.written.push((path, names));
        self.pending_bytes = 0;
        Ok(())
    }

    /// Flushes the last shard, gives shards their final HF names and writes the index.
    /// Returns the number of tensor bytes written.
    pub fn finish(mut self) -> Result<usize, CheckpointError> {
        if !self.pending.is_empty() || self.written.is_empty() {
            self.flush()?;
        }
        let n = self.written.len();
        let mut weight_map = BTreeMap::new();
        for (i, (tmp, names)) in self.written.iter().enumerate() {
            let file = if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
            };
            let final_path = self.dir.join(&file);
            std::fs::rename(tmp, &final_path).map_err(io_err(&final_path))?;
            for name in names {
                weight_map.insert(name.clone(), file.clone());
            }
        }
        if n > 1 {
            let index = serde_json::json!({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map});
            let path = self.dir.join("model.safetensors.index.json");
            std::fs::write(
                &path,
                serde_json::to_string_pretty(&index).expect("index serializes"),
            )
            .map_err(io_err(&path))?;
        }
        Ok(self.total_bytes)
    }
}

/// One tensor of a served weight in checkpoint layout: the name suffix `lockstep convert`
/// writes it under (`weight`, `weight_scale`, ...), its dtype, shape and bytes. What
/// `GET /weights_checksum` hashes, and what `lockstep push --quantize-on-client` sends.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointPart<'a> {
    pub suffix: &'static str,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Cow<'a, [u8]>,
}

// Checkpoint bytes are little-endian; the borrowed views below reinterpret memory as such.
#[cfg(target_endian = "big")]
compile_error!("lockstep assumes a little-endian target (safetensors is little-endian)");

impl<'a> CheckpointPart<'a> {
    pub fn bf16(suffix: &'static str, shape: Vec<usize>, values: &'a [bf16]) -> Self {
        CheckpointPart {
            suffix,
            dtype: Dtype::BF16,
            shape,
            data: Cow::Borrowed(bytemuck::cast_slice(values)),
        }
    }

    /// A high-precision tensor the server holds widened to f32: written back as BF16 when
    /// every value is a BF16 value (always so for a BF16 checkpoint, whose bytes this gives
    /// back exactly), else as F32.
    pub fn from_f32(suffix: &'static str, shape: Vec<usize>, values: &'a [f32]) -> Self {
        let narrow = |v: &f32| v.to_bits() & 0xFFFF == 0;
        if values.iter().all(narrow) {
            CheckpointPart {
                suffix,
                dtype: Dtype::BF16,
                shape,
                data: Cow::Owned(
                    values
                        .iter()
                        .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                        .collect(),
                ),
            }
        } else {
            CheckpointPart {
                suffix,
                dtype: Dtype::F32,
                shape,
                data: Cow::Borrowed(bytemuck::cast_slice(values)),
            }
        }
    }

    pub fn bytes(suffix: &'static str, dtype: Dtype, shape: Vec<usize>, data: &'a [u8]) -> Self {
        CheckpointPart {
            suffix,
            dtype,
            shape,
            data: Cow::Borrowed(data),
        }
    }

    pub fn into_owned(self) -> CheckpointPart<'static> {
        CheckpointPart {
            data: Cow::Owned(self.data.into_owned()),
            ..self
        }
    }

    pub fn to_owned_tensor(&self) -> OwnedTensor {
        OwnedTensor::new(self.dtype, self.shape.clone(), self.data.to_vec())
    }
}

impl View for &CheckpointPart<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This process's resident bytes of the mapping that holds `at` (`/proc/self/smaps`).
    #[cfg(target_os = "linux")]
    fn resident_bytes_of_mapping(at: *const u8) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let at = at as usize;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line
                .split_whitespace()
                .next()
                .and_then(|r| r.split_once('-'));
            if let Some((a, b)) = range.filter(|_| !line.contains(": ") && !line.ends_with(':')) {
                let (a, b) = (
                    usize::from_str_radix(a, 16).unwrap_or(0),
                    usize::from_str_radix(b, 16).unwrap_or(0),
                );
                inside = a <= at && at < b;
            } else if inside && line.starts_with("Rss:") {
                let kb: usize = line.split_whitespace().nth(1).unwrap().parse().unwrap();
                return kb * 1024;
            }
        }
        panic!("no mapping holds {at:#x}");
    }

    /// Released pages leave the resident set and read back the same bytes.
    #[cfg(target_os = "linux")]
    #[test]
    fn released_pages_leave_the_resident_set_and_read_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let bytes: Vec<u8> = (0..16usize << 20)
            .map(|i| (i * 7 + i / 4096) as u8)
            .collect();
        let view = TensorView::new(Dtype::U8, vec![bytes.len()], &bytes).unwrap();
        safetensors::serialize_to_file([("w", &view)], None, &path).unwrap();
        let file = SafetensorsFile::open(&path).unwrap();
        let data = file.tensor("w").unwrap().data().as_ptr();
        let read_all = |f: &SafetensorsFile| {
            let t = f.tensor("w").unwrap();
            // One read per page maps every page (and checks the bytes).
            assert!(t.data() == &bytes[..]);
        };
        read_all(&file);
        let touched = resident_bytes_of_mapping(data);
        assert!(
            touched >= 16 << 20,
            "{touched} bytes resident after reading 16 MiB"
        );
        file.release_pages();
        let released = resident_bytes_of_mapping(data);
        assert!(
            released < 1 << 20,
            "{released} bytes resident after the release"
        );
        read_all(&file);
    }

    /// Views from the header parsed at open are the crate's own views of the same file, tensor
    /// for tensor, across dtypes and shapes, and share the map; an unknown name is `Missing`.
    #[test]
    fn tensors_read_from_the_parsed_header_equal_the_crates_views() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let bytes: Vec<Vec<u8>> = (0..40u8)
            .map(|i| (0..(i as usize % 7 + 1) * 8).map(|j| i ^ j as u8).collect())
            .collect();
        let views: Vec<(String, TensorView<'_>)> = bytes
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let (dtype, shape) = match i % 3 {
                    0 => (Dtype::F32, vec![b.len() / 4]),
                    1 => (Dtype::BF16, vec![2, b.len() / 4]),
                    _ => (Dtype::U8, vec![b.len()]),
                };
                (format!("t{i}"), TensorView::new(dtype, shape, b).unwrap())
            })
            .collect();
        safetensors::serialize_to_file(views.iter().map(|(n, v)| (n.as_str(), v)), None, &path)
            .unwrap();
        let file = SafetensorsFile::open(&path).unwrap();
        let mut names: Vec<String> = file.names().collect();
        names.sort();
        let mut want_names: Vec<String> = views.iter().map(|(n, _)| n.clone()).collect();
        want_names.sort();
        assert_eq!(names, want_names);
        let st = file.view().unwrap();
        for (name, written) in &views {
            let got = file.tensor(name).unwrap();
            let want = st.tensor(name).unwrap();
            assert_eq!(got.dtype(), want.dtype(), "{name}");
            assert_eq!(got.shape(), want.shape(), "{name}");
            assert_eq!(got.data(), want.data(), "{name}");
            assert_eq!(got.data(), written.data(), "{name}");
            // Shared bytes are the map's own memory, not a copy, and outlive the view.
            let shared = file.shared(got.data()).unwrap();
            assert_eq!(shared.as_ptr(), got.data().as_ptr(), "{name}");
            assert_eq!(&shared[..], written.data(), "{name}");
            assert!(
                file.shared(written.data()).is_none(),
                "bytes of another buffer"
            );
        }
        assert!(matches!(
            file.tensor("absent"),
            Err(CheckpointError::Missing(_))
        ));
    }
}
