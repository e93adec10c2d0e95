//! SGLang's `/update_weights_from_tensor` payload, read without Python: each entry of
//! `serialized_named_tensors` is `base64(ForkingPickler.dumps(obj))` (SGLang's
//! `MultiprocessingSerializer`), where `obj` is, by `load_format`:
//! - None / `direct`: a list of `(name, tensor)` pairs; a tensor may also be SGLang's
//!   `LocalSerializedTensor(values=[one nested pickle per TP rank])`;
//! - `flattened_bucket`: `{"flattened_tensor": uint8 tensor, "metadata":
//!   [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]}`.
//!
//! A CUDA tensor is `rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype,
//! device, storage_handle, storage_size_bytes, storage_offset_bytes, requires_grad,
//! ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)` (torch's
//! `reduce_tensor`); this module turns those into [`IpcSource`]s (byte ranges of shared
//! allocations) and the named tensors cut from them. CPU tensors (torch's fd / shared-file
//! storage sharing) are refused: a file descriptor cannot cross HTTP.

use safetensors::tensor::Dtype;

use super::errors::ApiError;
use super::pickle::{self, Global, Value};
use crate::backend::cuda::ipc::{release_counters, IpcSource, RefCounter, IPC_HANDLE_BYTES};

const FIELD: &str = "serialized_named_tensors";

/// One named tensor of the payload: `len` bytes at `start` of source `source`.
#[derive(Clone, Debug, PartialEq)]
pub struct SharedTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub source: usize,
    pub start: usize,
    pub len: usize,
}

/// The decoded payload: the byte ranges to copy and the tensors they hold.
#[derive(Debug, Default, PartialEq)]
pub struct Payload {
    pub sources: Vec<IpcSource>,
    pub tensors: Vec<SharedTensor>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadFormat {
    /// None or `direct`: a list of (name, tensor).
    Pairs,
    FlattenedBucket,
}

impl LoadFormat {
    pub fn parse(s: Option<&str>) -> Result<LoadFormat, ApiError> {
        match s {
            None | Some("direct") => Ok(LoadFormat::Pairs),
            Some("flattened_bucket") => Ok(LoadFormat::FlattenedBucket),
            Some(other) => Err(ApiError::invalid(
                "load_format",
                format!("load_format `{other}` is not one of null, direct, flattened_bucket (custom weight loaders are not supported)"),
            )),
        }
    }
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::invalid(FIELD, message)
}

/// The one entry this server (tensor-parallel size 1) reads: SGLang sends one per TP rank.
pub fn own_entry(entries: &[String]) -> Result<&str, ApiError> {
    match entries {
        [] => Err(bad("serialized_named_tensors is empty: one base64 string per tensor-parallel rank is expected (this server has tp_size 1)")),
        [one] => Ok(one),
        [first, rest @ ..] if rest.iter().all(|e| e == first) => Ok(first),
        many => Err(bad(format!(
            "serialized_named_tensors has {} different entries (one per tensor-parallel rank) but this server has tp_size 1: send one",
            many.len()
        ))),
    }
}

/// Decodes one entry (base64 of a pickle) in `format`. A payload refused here gives back the
/// producer's reference of every CUDA tensor in it (so the trainer can free them): nothing
/// else will.
pub fn decode(entry: &str, format: LoadFormat) -> Result<Payload, ApiError> {
    use base64::Engine;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(entry.trim())
        .map_err(|e| bad(format!("serialized_named_tensors is not base64: {e}")))?;
    let obj = loads(&raw)?;
    decode_value(&obj, format).inspect_err(|_| release_counters(&counters_in(&obj)))
}

/// The producer's reference counters of every CUDA tensor in `v` (those nested in SGLang's
/// `LocalSerializedTensor` too, where their pickles read), whatever else is wrong with them.
fn counters_in(v: &Value) -> Vec<RefCounter> {
    let mut out = Vec::new();
    let mut walk = vec![v.clone()];
    while let Some(v) = walk.pop() {
        match v {
            Value::Call(Global::RebuildCudaTensor, args) => {
                if let (Some(Value::Bytes(f)), Some(Value::Int(i))) = (args.get(11), args.get(12)) {
                    if let (Ok(file), Ok(index)) =
                        (String::from_utf8(f.clone()), usize::try_from(*i))
                    {
                        if !file.is_empty() {
                            out.push(RefCounter { file, index });
                        }
                    }
                }
            }
            Value::Object(Global::LocalSerializedTensor, Some(state)) => {
                let nested = state.get("values").and_then(Value::as_seq).unwrap_or(&[]);
                for n in nested {
                    let raw = match n {
                        Value::Bytes(b) => Some(b.clone()),
                        Value::Str(s) => {
                            use base64::Engine;
                            base64::engine::general_purpose::STANDARD
                                .decode(s.trim())
                                .ok()
                        }
                        _ => None,
                    };
                    if let Some(inner) = raw.and_then(|r| pickle::loads(&r).ok()) {
                        walk.push(inner);
                    }
                }
            }
            Value::Tuple(items) | Value::List(items) | Value::Call(_, items) => walk.extend(items),
            Value::Dict(items) => walk.extend(items.into_iter().flat_map(|(k, v)| [k, v])),
            Value::Object(_, Some(state)) => walk.push(*state),
            _ => {}
        }
    }
    out
}

fn decode_value(obj: &Value, format: LoadFormat) -> Result<Payload, ApiError> {
    let mut p = Payload::default();
    match format {
        LoadFormat::Pairs => {
            let items = obj.as_seq().ok_or_else(|| {
                bad(format!(
                    "with load_format null or direct serialized_named_tensors must hold a list of (name, tensor) pairs, not a {}",
                    obj.kind()
                ))
            })?;
            for item in items {
                let pair = item.as_seq().filter(|s| s.len() == 2);
                let (name, t) = match pair.map(|s| (s[0].as_str(), &s[1])) {
                    Some((Some(name), t)) => (name.to_string(), t),
                    _ => {
                        return Err(bad(format!(
                            "an item of the list is a {}, not a (name, tensor) pair",
                            item.kind()
                        )))
                    }
                };
                let t = local_serialized(&name, t)?;
                let shared = cuda_tensor(&name, &t)?;
                let len = shared.len;
                p.sources.push(shared.source);
                p.tensors.push(SharedTensor {
                    name,
                    dtype: shared.dtype,
                    shape: shared.shape,
                    source: p.sources.len() - 1,
                    start: 0,
                    len,
                });
            }
        }
        LoadFormat::FlattenedBucket => {
            let (Some(flat), Some(meta)) = (obj.get("flattened_tensor"), obj.get("metadata"))
            else {
                return Err(bad(format!(
                    "with load_format flattened_bucket serialized_named_tensors must hold a dict with `flattened_tensor` and `metadata`, not a {}",
                    obj.kind()
                )));
            };
            let flat = cuda_tensor("flattened_tensor", flat)?;
            if flat.shape.len() != 1 {
                return Err(bad(format!(
                    "flattened_tensor has shape {:?}; a flattened bucket is one-dimensional",
                    flat.shape
                )));
            }
            let total = flat.len;
            p.sources.push(flat.source);
            let meta = meta
                .as_seq()
                .ok_or_else(|| bad("flattened bucket `metadata` is not a list"))?;
            for m in meta {
                p.tensors.push(bucket_entry(m, total)?);
            }
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    for t in &p.tensors {
        if !seen.insert(t.name.as_str()) {
            return Err(ApiError::invalid(
                &t.name,
                format!(
                    "tensor `{}` appears twice in serialized_named_tensors",
                    t.name
                ),
            ));
        }
    }
    Ok(p)
}

fn loads(raw: &[u8]) -> Result<Value, ApiError> {
    pickle::loads(raw).map_err(|e| bad(format!("serialized_named_tensors: {e}")))
}

/// SGLang's `LocalSerializedTensor(values=[pickle per TP rank])` unwrapped to rank 0's tensor;
/// anything else as it is.
fn local_serialized(name: &str, t: &Value) -> Result<Value, ApiError> {
    let Value::Object(Global::LocalSerializedTensor, state) = t else {
        return Ok(t.clone());
    };
    let values = state
        .as_deref()
        .and_then(|s| s.get("values"))
        .and_then(Value::as_seq)
        .ok_or_else(|| {
            ApiError::invalid(
                name,
                format!("tensor `{name}`: LocalSerializedTensor without a `values` list"),
            )
        })?;
    let own = match values {
        [one] => one,
        [first, rest @ ..] if rest.iter().all(|v| v == first) => first,
        _ => {
            return Err(ApiError::invalid(
                name,
                format!("tensor `{name}`: LocalSerializedTensor holds {} ranks' tensors but this server has tp_size 1", values.len()),
            ))
        }
    };
    let raw = match own {
        Value::Bytes(b) => b.clone(),
        Value::Str(s) => {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD
                .decode(s.trim())
                .map_err(|e| {
                    ApiError::invalid(
                        name,
                        format!("tensor `{name}`: LocalSerializedTensor value is not base64: {e}"),
                    )
                })?
        }
        other => {
            return Err(ApiError::invalid(
                name,
                format!(
                    "tensor `{name}`: LocalSerializedTensor value is a {}, not bytes",
                    other.kind()
                ),
            ))
        }
    };
    pickle::loads(&raw).map_err(|e| ApiError::invalid(name, format!("tensor `{name}`: {e}")))
}

/// A contiguous CUDA tensor as a byte range of a shared allocation.
struct Cuda {
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
    source: IpcSource,
}

/// The dtype a pickled `torch.<dtype>` names; why not, for the tensor's error.
fn torch_dtype(v: &Value) -> Result<Dtype, String> {
    match v {
        Value::Global(Global::Dtype(d)) => {
            dtype_of(d).ok_or_else(|| format!("dtype torch.{d} is not supported"))
        }
        other => Err(format!("dtype is a {}, not a torch dtype", other.kind())),
    }
}

/// torch's dtype attribute name -> the checkpoint dtype of the same bytes.
pub fn dtype_of(torch_name: &str) -> Option<Dtype> {
    Some(match torch_name {
        "bfloat16" => Dtype::BF16,
        "float16" | "half" => Dtype::F16,
        "float32" | "float" => Dtype::F32,
        "float64" | "double" => Dtype::F64,
        "uint8" => Dtype::U8,
        "int8" => Dtype::I8,
        "int16" | "short" => Dtype::I16,
        "uint16" => Dtype::U16,
        "int32" | "int" => Dtype::I32,
        "uint32" => Dtype::U32,
        "int64" | "long" => Dtype::I64,
        "uint64" => Dtype::U64,
        "bool" => Dtype::BOOL,
        "float8_e4m3fn" => Dtype::F8_E4M3,
        "float8_e5m2" => Dtype::F8_E5M2,
        "float8_e8m0fnu" => Dtype::F8_E8M0,
        // Two E2M1 values per byte: the checkpoint's packed `uint8` NVFP4 weight.
        "float4_e2m1fn_x2" => Dtype::U8,
        _ => return None,
    })
}

fn ints(name: &str, what: &str, v: &Value) -> Result<Vec<usize>, ApiError> {
    // torch.Size pickles as `torch.Size((d0, d1, ...))`.
    let v = match v {
        Value::Call(Global::Size, args) if args.len() == 1 => &args[0],
        v => v,
    };
    let items = v.as_seq().ok_or_else(|| {
        ApiError::invalid(
            name,
            format!(
                "tensor `{name}`: {what} is a {}, not a tuple of ints",
                v.kind()
            ),
        )
    })?;
    items
        .iter()
        .map(|i| {
            i.as_int()
                .and_then(|i| usize::try_from(i).ok())
                .ok_or_else(|| {
                    ApiError::invalid(
                        name,
                        format!(
                            "tensor `{name}`: {what} holds a {}, not a non-negative int",
                            i.kind()
                        ),
                    )
                })
        })
        .collect()
}

fn handle(name: &str, what: &str, v: &Value) -> Result<[u8; IPC_HANDLE_BYTES], ApiError> {
    let Value::Bytes(b) = v else {
        return Err(ApiError::invalid(
            name,
            format!("tensor `{name}`: {what} is a {}, not bytes", v.kind()),
        ));
    };
    b.as_slice().try_into().map_err(|_| {
        ApiError::invalid(
            name,
            format!(
                "tensor `{name}`: {what} has {} bytes, expected {IPC_HANDLE_BYTES}",
                b.len()
            ),
        )
    })
}

/// The 64-byte `cudaIpcMemHandle_t` in torch's storage handle: torch >= 2.2 writes
/// `[version byte][type byte]` first (`shareIpcHandle`: type `c` = a cudaMalloc block,
/// `e` = an expandable segment); older torch wrote the 64 bytes alone.
fn mem_handle(name: &str, v: &Value) -> Result<[u8; IPC_HANDLE_BYTES], ApiError> {
    match v {
        Value::Bytes(b) if b.len() == IPC_HANDLE_BYTES + 2 && b[1] == b'c' => {
            Ok(b[2..].try_into().expect("64 bytes"))
        }
        Value::Bytes(b) if b.len() >= 2 && b[1] == b'e' && b.len() != IPC_HANDLE_BYTES => Err(ApiError::invalid(
            name,
            format!("tensor `{name}` lives in an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the trainer), whose handles are not supported: allocate the tensors to send without expandable segments"),
        )),
        Value::None => Err(ApiError::invalid(name, format!("tensor `{name}` has no storage (an empty tensor)"))),
        v => handle(name, "storage_handle", v),
    }
}

fn elem_bytes(d: Dtype) -> usize {
    d.bitsize().div_ceil(8)
}

fn cuda_tensor(name: &str, t: &Value) -> Result<Cuda, ApiError> {
    let err = |m: String| ApiError::invalid(name, format!("tensor `{name}`: {m}"));
    let args = match t {
        Value::Call(Global::RebuildCudaTensor, args) => args,
        Value::Call(Global::RebuildTensor, _) => {
            return Err(err("a CPU tensor (torch shares it through a file descriptor or shared-memory file, which cannot cross HTTP): send CUDA tensors, or stream safetensors buckets with PUT /update_weights".into()))
        }
        other => return Err(err(format!("a {}, not a CUDA tensor (torch.multiprocessing.reductions.rebuild_cuda_tensor)", other.kind()))),
    };
    if args.len() != 15 {
        return Err(err(format!(
            "rebuild_cuda_tensor with {} arguments, expected 15",
            args.len()
        )));
    }
    let int = |i: usize, what: &str| {
        args[i]
            .as_int()
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| {
                err(format!(
                    "{what} is a {}, not a non-negative int",
                    args[i].kind()
                ))
            })
    };
    if !matches!(args[0], Value::Global(Global::TensorClass)) {
        return Err(err(
            "tensor_cls is not torch.Tensor or torch.nn.Parameter".into()
        ));
    }
    let shape = ints(name, "tensor_size", &args[1])?;
    let stride = ints(name, "tensor_stride", &args[2])?;
    let tensor_offset = int(3, "tensor_offset")?;
    let dtype = torch_dtype(&args[5]).map_err(err)?;
    // One GPU: the device index (or, from SGLang's patched reductions, its UUID) is not
    // needed to find the allocation; the handle names it.
    match &args[6] {
        Value::Int(_) | Value::Str(_) => {}
        other => {
            return Err(err(format!(
                "storage_device is a {}, not an int or a UUID",
                other.kind()
            )))
        }
    }
    let handle = mem_handle(name, &args[7])?;
    let storage_size = int(8, "storage_size_bytes")?;
    let storage_offset = int(9, "storage_offset_bytes")?;
    let ref_counter = match (&args[11], &args[12]) {
        (Value::Bytes(f), Value::Int(i)) if !f.is_empty() => Some(RefCounter {
            file: String::from_utf8(f.clone())
                .map_err(|_| err("ref_counter_handle is not a file name".into()))?,
            index: usize::try_from(*i).map_err(|_| err("ref_counter_offset is negative".into()))?,
        }),
        (Value::None, _) => None,
        _ => {
            return Err(err(
                "ref_counter_handle / ref_counter_offset are not bytes and an int".into(),
            ))
        }
    };
    let event = match &args[14] {
        Value::Bool(true) => Some(handle_of_event(name, &args[13])?),
        Value::Bool(false) | Value::None => None,
        other => {
            return Err(err(format!(
                "event_sync_required is a {}, not a bool",
                other.kind()
            )))
        }
    };
    if stride.len() != shape.len() {
        return Err(err(format!(
            "stride {stride:?} does not match shape {shape:?}"
        )));
    }
    // Row-major contiguous; a dimension of size 1 may have any stride.
    let mut want = 1usize;
    for (d, s) in shape.iter().zip(&stride).rev() {
        if *d != 1 && *s != want {
            return Err(err(format!(
                "not contiguous (shape {shape:?}, stride {stride:?}): call .contiguous() before sending"
            )));
        }
        want = want.saturating_mul(*d);
    }
    let elem = elem_bytes(dtype);
    let numel: usize = shape.iter().product();
    let len = numel * elem;
    let start = tensor_offset * elem;
    if start + len > storage_size {
        return Err(err(format!(
            "bytes {start}..{} lie outside its storage of {storage_size} bytes",
            start + len
        )));
    }
    Ok(Cuda {
        dtype,
        shape,
        len,
        source: IpcSource {
            name: name.to_string(),
            handle,
            offset: storage_offset + start,
            len,
            event,
            ref_counter,
        },
    })
}

fn handle_of_event(name: &str, v: &Value) -> Result<[u8; IPC_HANDLE_BYTES], ApiError> {
    handle(name, "event_handle", v)
}

/// One `FlattenedTensorMetadata` of a bucket of `total` bytes.
fn bucket_entry(m: &Value, total: usize) -> Result<SharedTensor, ApiError> {
    let state = match m {
        Value::Object(Global::FlattenedTensorMetadata, Some(state)) => state,
        other => {
            return Err(bad(format!(
                "flattened bucket metadata holds a {}, not a FlattenedTensorMetadata",
                other.kind()
            )))
        }
    };
    let name = state
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("a FlattenedTensorMetadata has no `name`"))?
        .to_string();
    let err = |m: String| ApiError::invalid(&name, format!("tensor `{name}`: {m}"));
    let field = |k: &str| {
        state
            .get(k)
            .ok_or_else(|| err(format!("no `{k}` in its FlattenedTensorMetadata")))
    };
    let shape = ints(&name, "shape", field("shape")?)?;
    let dtype = torch_dtype(field("dtype")?).map_err(err)?;
    let idx = |k: &str| {
        field(k)?
            .as_int()
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| err(format!("`{k}` is not a non-negative int")))
    };
    let (start, end) = (idx("start_idx")?, idx("end_idx")?);
    let len = shape.iter().product::<usize>() * elem_bytes(dtype);
    if end < start || end - start != len || end > total {
        return Err(err(format!(
            "bytes {start}..{end} of a {total}-byte bucket do not hold a {dtype:?} tensor of shape {shape:?} ({len} bytes)"
        )));
    }
    Ok(SharedTensor {
        name,
        dtype,
        shape,
        source: 0,
        start,
        len,
    })
}

#[cfg(test)]
mod tests {
    //! On the payloads scripts/make_tensor_ipc_fixtures.py writes (what torch's ForkingPickler
    //! and SGLang's serializer produce, made without torch).
    use super::*;

    fn fixture(name: &str) -> String {
        let path = format!(
            "{}/tests/data/tensor_ipc/{name}.b64",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    fn message(e: ApiError) -> (Option<String>, String) {
        match &e {
            ApiError::Invalid { param, .. } => (param.clone(), e.to_string()),
            other => panic!("not a 400: {other:?}"),
        }
    }

    fn handle(seed: u8) -> [u8; 64] {
        std::array::from_fn(|i| seed.wrapping_add(i as u8))
    }

    #[test]
    fn direct_list_of_cuda_tensors() {
        let p = decode(&fixture("direct"), LoadFormat::Pairs).unwrap();
        assert_eq!(p.tensors.len(), 2);
        assert_eq!(p.tensors[0].name, "model.norm.weight");
        assert_eq!(
            (p.tensors[0].dtype, p.tensors[0].shape.clone()),
            (Dtype::BF16, vec![128])
        );
        let gate = &p.tensors[1];
        assert_eq!(
            (gate.dtype, gate.shape.clone(), gate.len),
            (Dtype::BF16, vec![8, 128], 2048)
        );
        assert_eq!((gate.source, gate.start), (1, 0));
        let s = &p.sources[1];
        assert_eq!(s.handle, handle(2));
        // storage_offset_bytes 512 + tensor_offset 16 elements of 2 bytes.
        assert_eq!((s.offset, s.len), (512 + 32, 2048));
        assert_eq!(s.event, Some(std::array::from_fn(|i| (2 * 7 + i) as u8)));
        assert_eq!(
            s.ref_counter,
            Some(RefCounter {
                file: "/torch_4242_1234567_0".into(),
                index: 5
            })
        );
    }

    #[test]
    fn flattened_bucket() {
        let p = decode(&fixture("flattened_bucket"), LoadFormat::FlattenedBucket).unwrap();
        assert_eq!(p.sources.len(), 1);
        assert_eq!((p.sources[0].offset, p.sources[0].len), (1024, 2304));
        assert_eq!(p.sources[0].handle, handle(3));
        let got: Vec<_> = p
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.start, t.len))
            .collect();
        assert_eq!(
            got,
            [
                ("model.norm.weight", 0, 256),
                ("model.layers.0.mlp.gate.weight", 256, 2048)
            ]
        );
        assert_eq!(p.tensors[1].shape, [8, 128]);
        // The same payload read as a list of pairs is a clear 400.
        let (param, m) =
            message(decode(&fixture("flattened_bucket"), LoadFormat::Pairs).unwrap_err());
        assert_eq!(param.as_deref(), Some(FIELD));
        assert!(m.contains("list of (name, tensor) pairs"), "{m}");
    }

    #[test]
    fn sglang_local_serialized_tensors_with_a_device_uuid() {
        let p = decode(&fixture("local_serialized"), LoadFormat::Pairs).unwrap();
        assert_eq!(p.tensors.len(), 1);
        assert_eq!(p.tensors[0].shape, [128]);
        assert_eq!(p.sources[0].handle, handle(4));
    }

    #[test]
    fn refusals_name_the_field_or_the_tensor() {
        let cases = [
            ("cpu_tensor", "model.norm.weight", "CPU tensor"),
            ("forbidden_global", FIELD, "`posix.system` is not allowed"),
            (
                "noncontiguous",
                "model.layers.0.mlp.gate.weight",
                "not contiguous",
            ),
            ("bad_dtype", FIELD, "torch.complex64"),
            ("truncated", FIELD, "truncated"),
        ];
        for (f, param, text) in cases {
            let (p, m) = message(decode(&fixture(f), LoadFormat::Pairs).unwrap_err());
            assert_eq!(p.as_deref(), Some(param), "{f}: {m}");
            assert!(m.contains(text), "{f}: {m}");
        }
        let (p, m) = message(decode("not base64!", LoadFormat::Pairs).unwrap_err());
        assert_eq!(p.as_deref(), Some(FIELD));
        assert!(m.contains("base64"), "{m}");
        let (p, _) = message(LoadFormat::parse(Some("my.loader")).unwrap_err());
        assert_eq!(p.as_deref(), Some("load_format"));
    }

    /// A refused payload's tensors are found whatever is wrong with them, so their producer's
    /// references go back (decode releases them) and the trainer can free the memory. (A
    /// pickle refused as a whole, e.g. for a global outside the allow-list, names none.)
    #[test]
    fn a_refused_payload_names_every_reference_to_give_back() {
        use base64::Engine;
        let counters = |f: &str| {
            let raw = base64::engine::general_purpose::STANDARD
                .decode(fixture(f).trim())
                .unwrap();
            let mut c = counters_in(&pickle::loads(&raw).unwrap());
            c.sort_by_key(|c| c.index);
            c
        };
        let rc = |index| RefCounter {
            file: "/torch_4242_1234567_0".into(),
            index,
        };
        assert_eq!(counters("noncontiguous"), [rc(0)]);
        assert_eq!(counters("unknown_name"), [rc(0)]);
        assert_eq!(counters("direct"), [rc(0), rc(5)]);
        assert_eq!(counters("flattened_bucket"), [rc(0)]);
        assert_eq!(counters("local_serialized"), [rc(0)]);
        assert_eq!(counters("cpu_tensor"), []);
    }

    #[test]
    fn one_entry_per_rank() {
        assert_eq!(own_entry(&["a".into()]).unwrap(), "a");
        assert_eq!(own_entry(&["a".into(), "a".into()]).unwrap(), "a");
        assert!(own_entry(&["a".into(), "b".into()]).is_err());
        assert!(own_entry(&[]).is_err());
    }
}
