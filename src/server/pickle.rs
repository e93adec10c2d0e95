//! A strict reader for the pickles `/update_weights_from_tensor` receives: what SGLang's
//! `MultiprocessingSerializer` (torch's `ForkingPickler`, protocol 2 to 5) writes for lists,
//! dicts and dataclasses of torch tensors. It builds a value tree and never runs anything: a
//! GLOBAL is only ever a name, and only the names in [`Global`] are accepted; any other
//! global or opcode is an error naming it.

use std::cell::RefCell;
use std::rc::Rc;

/// A torch callable or class the payload may name. Nothing else may appear as a GLOBAL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Global {
    /// `torch.bfloat16` etc.: a dtype, by its torch attribute name.
    Dtype(String),
    /// `torch.Size`.
    Size,
    /// `torch.Tensor` or `torch.nn.parameter.Parameter`: the class of a rebuilt tensor.
    TensorClass,
    /// `torch.storage.TypedStorage` / `UntypedStorage` / `torch.<X>Storage`.
    StorageClass,
    /// `torch.multiprocessing.reductions.rebuild_cuda_tensor`, or SGLang's patched copy
    /// (`sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified`, device given as a UUID).
    RebuildCudaTensor,
    /// `torch.multiprocessing.reductions.rebuild_tensor` (a CPU tensor).
    RebuildTensor,
    /// `rebuild_storage_fd`, `rebuild_storage_filename`, `rebuild_typed_storage`, ...: a CPU
    /// storage shared through a file descriptor or shared memory.
    RebuildCpuStorage(String),
    /// `multiprocessing.resource_sharer.DupFd` (the fd strategy's descriptor).
    DupFd,
    /// `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`.
    FlattenedTensorMetadata,
    /// `...weight_updater.LocalSerializedTensor`: one nested pickle per tensor-parallel rank.
    LocalSerializedTensor,
}

const DTYPES: &[&str] = &[
    "bfloat16",
    "float16",
    "half",
    "float32",
    "float",
    "float64",
    "double",
    "uint8",
    "int8",
    "int16",
    "short",
    "int32",
    "int",
    "int64",
    "long",
    "bool",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
];

impl Global {
    fn lookup(module: &str, name: &str) -> Option<Global> {
        Some(match (module, name) {
            ("torch", n) if DTYPES.contains(&n) => Global::Dtype(n.to_string()),
            ("torch", "Size") => Global::Size,
            ("torch", "Tensor")
            | ("torch._tensor", "Tensor")
            | ("torch.nn.parameter", "Parameter") => Global::TensorClass,
            ("torch.storage", "TypedStorage" | "UntypedStorage" | "_UntypedStorage")
            | ("torch", "UntypedStorage") => Global::StorageClass,
            ("torch", n) | ("torch.cuda", n) if n.ends_with("Storage") => Global::StorageClass,
            ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
            | ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified") => {
                Global::RebuildCudaTensor
            }
            ("torch.multiprocessing.reductions", "rebuild_tensor") => Global::RebuildTensor,
            (
                "torch.multiprocessing.reductions",
                n @ ("rebuild_storage_fd"
                | "rebuild_storage_filename"
                | "rebuild_storage_empty"
                | "rebuild_typed_storage"
                | "rebuild_typed_storage_child"),
            ) => Global::RebuildCpuStorage(n.to_string()),
            ("multiprocessing.resource_sharer", "DupFd") => Global::DupFd,
            ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata") => {
                Global::FlattenedTensorMetadata
            }
            (
                "sglang.srt.model_executor.model_runner_components.weight_updater"
                | "sglang.srt.model_executor.model_runner",
                "LocalSerializedTensor",
            ) => Global::LocalSerializedTensor,
            _ => return None,
        })
    }
}

/// A value the payload built.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    Global(Global),
    /// `callable(*args)` (REDUCE), not called.
    Call(Global, Vec<Value>),
    /// `cls.__new__(cls)` then `__setstate__(state)` (NEWOBJ + BUILD): a dataclass.
    Object(Global, Option<Box<Value>>),
}

impl Value {
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(*b as i64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// The items of a tuple or list.
    pub fn as_seq(&self) -> Option<&[Value]> {
        match self {
            Value::Tuple(v) | Value::List(v) => Some(v),
            _ => None,
        }
    }
    /// The value of string key `key` of a dict.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }
    /// A short description for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::Tuple(_) => "tuple",
            Value::List(_) => "list",
            Value::Dict(_) => "dict",
            Value::Global(_) => "global",
            Value::Call(..) => "reduce call",
            Value::Object(..) => "object",
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PickleError {
    #[error("the pickle ends early (at byte {0}): truncated data")]
    Truncated(usize),
    #[error("pickle opcode 0x{op:02x} ({name}) at byte {at} is not accepted (only the opcodes torch's ForkingPickler writes for named tensors are)")]
    Opcode {
        op: u8,
        name: &'static str,
        at: usize,
    },
    #[error("pickle global `{module}.{name}` is not allowed: only torch's tensor-rebuilding functions, dtypes and SGLang's tensor containers are accepted")]
    Forbidden { module: String, name: String },
    #[error("malformed pickle at byte {at}: {what}")]
    Malformed { at: usize, what: String },
    #[error("the pickle nests or shares objects beyond the limit (more than {0} values)")]
    TooLarge(usize),
}

/// Values built while reading: containers are shared (the memo refers to the same object the
/// stack holds, and APPENDS/SETITEMS after MEMOIZE must be seen through both).
#[derive(Clone, Debug)]
enum Obj {
    Leaf(Value),
    Tuple(Vec<Obj>),
    List(Rc<RefCell<Vec<Obj>>>),
    Dict(Rc<RefCell<Vec<(Obj, Obj)>>>),
    Call(Global, Vec<Obj>),
    Object(Global, Rc<RefCell<Option<Obj>>>),
    Mark,
}

/// The most values a payload may expand to (shared references are counted each time), so a
/// small payload that refers to the same list over and over cannot exhaust memory.
const MAX_VALUES: usize = 50_000_000;
const MAX_DEPTH: usize = 64;

fn freeze(o: &Obj, budget: &mut usize, depth: usize) -> Result<Value, PickleError> {
    if *budget == 0 || depth > MAX_DEPTH {
        return Err(PickleError::TooLarge(MAX_VALUES));
    }
    *budget -= 1;
    let all = |v: &[Obj], budget: &mut usize| {
        v.iter()
            .map(|o| freeze(o, budget, depth + 1))
            .collect::<Result<Vec<_>, _>>()
    };
    Ok(match o {
        Obj::Leaf(v) => v.clone(),
        Obj::Tuple(v) => Value::Tuple(all(v, budget)?),
        Obj::List(v) => Value::List(all(&v.borrow(), budget)?),
        Obj::Dict(d) => Value::Dict(
            d.borrow()
                .iter()
                .map(|(k, v)| Ok((freeze(k, budget, depth + 1)?, freeze(v, budget, depth + 1)?)))
                .collect::<Result<_, PickleError>>()?,
        ),
        Obj::Call(g, args) => Value::Call(g.clone(), all(args, budget)?),
        Obj::Object(g, state) => Value::Object(
            g.clone(),
            match &*state.borrow() {
                Some(s) => Some(Box::new(freeze(s, budget, depth + 1)?)),
                None => None,
            },
        ),
        Obj::Mark => {
            return Err(PickleError::Malformed {
                at: 0,
                what: "a MARK left on the stack".into(),
            })
        }
    })
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or(PickleError::Truncated(self.data.len()))?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<usize, PickleError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")) as usize)
    }
    fn u32(&mut self) -> Result<usize, PickleError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")) as usize)
    }
    fn u64(&mut self) -> Result<usize, PickleError> {
        let n = u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes"));
        usize::try_from(n).map_err(|_| PickleError::Truncated(self.data.len()))
    }
    fn line(&mut self) -> Result<&'a str, PickleError> {
        let rest = &self.data[self.pos..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(PickleError::Truncated(self.data.len()))?;
        let s = std::str::from_utf8(&rest[..n]).map_err(|_| PickleError::Malformed {
            at: self.pos,
            what: "a GLOBAL name that is not UTF-8".into(),
        })?;
        self.pos += n + 1;
        Ok(s)
    }
    fn utf8(&mut self, n: usize) -> Result<String, PickleError> {
        let at = self.pos;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| PickleError::Malformed {
            at,
            what: "a string that is not UTF-8".into(),
        })
    }
}

fn opcode_name(op: u8) -> &'static str {
    match op {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        _ => "unknown",
    }
}

/// Reads one pickle (the whole of `data`) into a value tree.
pub fn loads(data: &[u8]) -> Result<Value, PickleError> {
    let mut r = Reader { data, pos: 0 };
    let mut stack: Vec<Obj> = Vec::new();
    let mut memo: std::collections::HashMap<usize, Obj> = std::collections::HashMap::new();
    let malformed = |at: usize, what: &str| PickleError::Malformed {
        at,
        what: what.to_string(),
    };
    loop {
        let at = r.pos;
        let op = r.u8()?;
        let pop =
            |stack: &mut Vec<Obj>| stack.pop().ok_or_else(|| malformed(at, "stack underflow"));
        // Everything above the topmost MARK (which is removed).
        let pop_mark = |stack: &mut Vec<Obj>| -> Result<Vec<Obj>, PickleError> {
            let m = stack
                .iter()
                .rposition(|o| matches!(o, Obj::Mark))
                .ok_or_else(|| malformed(at, "no MARK on the stack"))?;
            let items = stack.split_off(m + 1);
            stack.pop();
            Ok(items)
        };
        match op {
            0x80 => {
                let proto = r.u8()?;
                if !(2..=5).contains(&proto) {
                    return Err(malformed(
                        at,
                        &format!("pickle protocol {proto} (2 to 5 are accepted)"),
                    ));
                }
            }
            0x95 => {
                r.u64()?;
            }
            b'.' => {
                let top = pop(&mut stack)?;
                if !stack.is_empty() {
                    return Err(malformed(at, "values left on the stack at STOP"));
                }
                if r.pos != data.len() {
                    return Err(malformed(r.pos, "bytes after STOP"));
                }
                let mut budget = MAX_VALUES;
                return freeze(&top, &mut budget, 0);
            }
            b'(' => stack.push(Obj::Mark),
            b'N' => stack.push(Obj::Leaf(Value::None)),
            0x88 => stack.push(Obj::Leaf(Value::Bool(true))),
            0x89 => stack.push(Obj::Leaf(Value::Bool(false))),
            b'J' => {
                let v = i32::from_le_bytes(r.take(4)?.try_into().expect("4 bytes"));
                stack.push(Obj::Leaf(Value::Int(v as i64)))
            }
            b'K' => {
                let v = r.u8()?;
                stack.push(Obj::Leaf(Value::Int(v as i64)))
            }
            b'M' => {
                let v = r.u16()?;
                stack.push(Obj::Leaf(Value::Int(v as i64)))
            }
            0x8a => {
                let n = r.u8()? as usize;
                if n > 8 {
                    return Err(malformed(
                        at,
                        &format!("an integer of {n} bytes (at most 8 are accepted)"),
                    ));
                }
                let b = r.take(n)?;
                let mut v: i64 = 0;
                for (i, &x) in b.iter().enumerate() {
                    v |= (x as i64) << (8 * i);
                }
                // Two's complement of n bytes: sign-extend.
                if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                    v -= 1i64 << (8 * n);
                }
                stack.push(Obj::Leaf(Value::Int(v)))
            }
            b'G' => {
                let v = f64::from_be_bytes(r.take(8)?.try_into().expect("8 bytes"));
                stack.push(Obj::Leaf(Value::Float(v)))
            }
            b'X' => {
                let n = r.u32()?;
                let s = r.utf8(n)?;
                stack.push(Obj::Leaf(Value::Str(s)))
            }
            0x8c => {
                let n = r.u8()? as usize;
                let s = r.utf8(n)?;
                stack.push(Obj::Leaf(Value::Str(s)))
            }
            0x8d => {
                let n = r.u64()?;
                let s = r.utf8(n)?;
                stack.push(Obj::Leaf(Value::Str(s)))
            }
            b'C' => {
                let n = r.u8()? as usize;
                stack.push(Obj::Leaf(Value::Bytes(r.take(n)?.to_vec())))
            }
            b'B' => {
                let n = r.u32()?;
                stack.push(Obj::Leaf(Value::Bytes(r.take(n)?.to_vec())))
            }
            0x8e => {
                let n = r.u64()?;
                stack.push(Obj::Leaf(Value::Bytes(r.take(n)?.to_vec())))
            }
            b')' => stack.push(Obj::Tuple(Vec::new())),
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                if stack.len() < n {
                    return Err(malformed(at, "stack underflow"));
                }
                let items = stack.split_off(stack.len() - n);
                if items.iter().any(|o| matches!(o, Obj::Mark)) {
                    return Err(malformed(at, "a MARK inside a tuple"));
                }
                stack.push(Obj::Tuple(items))
            }
            b't' => {
                let items = pop_mark(&mut stack)?;
                stack.push(Obj::Tuple(items))
            }
            b']' => stack.push(Obj::List(Rc::new(RefCell::new(Vec::new())))),
            b'l' => {
                let items = pop_mark(&mut stack)?;
                stack.push(Obj::List(Rc::new(RefCell::new(items))))
            }
            b'a' | b'e' => {
                let items = if op == b'a' {
                    vec![pop(&mut stack)?]
                } else {
                    pop_mark(&mut stack)?
                };
                match stack.last() {
                    Some(Obj::List(l)) => l.borrow_mut().extend(items),
                    _ => return Err(malformed(at, "APPEND(S) onto something that is not a list")),
                }
            }
            b'}' => stack.push(Obj::Dict(Rc::new(RefCell::new(Vec::new())))),
            b'd' | b's' | b'u' => {
                let items = match op {
                    b's' => {
                        let v = pop(&mut stack)?;
                        let k = pop(&mut stack)?;
                        vec![k, v]
                    }
                    _ => pop_mark(&mut stack)?,
                };
                if items.len() % 2 != 0 {
                    return Err(malformed(
                        at,
                        "a dict with an odd number of keys and values",
                    ));
                }
                let pairs = items.chunks(2).map(|kv| (kv[0].clone(), kv[1].clone()));
                if op == b'd' {
                    stack.push(Obj::Dict(Rc::new(RefCell::new(pairs.collect()))));
                } else {
                    match stack.last() {
                        Some(Obj::Dict(d)) => d.borrow_mut().extend(pairs),
                        _ => {
                            return Err(malformed(
                                at,
                                "SETITEM(S) onto something that is not a dict",
                            ))
                        }
                    }
                }
            }
            b'c' | 0x93 => {
                let (module, name) = if op == b'c' {
                    (r.line()?.to_string(), r.line()?.to_string())
                } else {
                    let name = pop(&mut stack)?;
                    let module = pop(&mut stack)?;
                    match (module, name) {
                        (Obj::Leaf(Value::Str(m)), Obj::Leaf(Value::Str(n))) => (m, n),
                        _ => {
                            return Err(malformed(
                                at,
                                "STACK_GLOBAL of values that are not strings",
                            ))
                        }
                    }
                };
                let g = Global::lookup(&module, &name)
                    .ok_or(PickleError::Forbidden { module, name })?;
                stack.push(Obj::Leaf(Value::Global(g)))
            }
            b'R' => {
                let args = pop(&mut stack)?;
                let f = pop(&mut stack)?;
                let (Obj::Leaf(Value::Global(g)), Obj::Tuple(args)) = (f, args) else {
                    return Err(malformed(at, "REDUCE needs a global and a tuple"));
                };
                stack.push(Obj::Call(g, args))
            }
            0x81 => {
                let args = pop(&mut stack)?;
                let cls = pop(&mut stack)?;
                let (Obj::Leaf(Value::Global(g)), Obj::Tuple(args)) = (cls, args) else {
                    return Err(malformed(at, "NEWOBJ needs a class and a tuple"));
                };
                if !args.is_empty() {
                    return Err(malformed(at, "NEWOBJ with arguments"));
                }
                stack.push(Obj::Object(g, Rc::new(RefCell::new(None))))
            }
            b'b' => {
                let state = pop(&mut stack)?;
                match stack.last() {
                    Some(Obj::Object(_, s)) => *s.borrow_mut() = Some(state),
                    _ => return Err(malformed(at, "BUILD onto something that is not an object")),
                }
            }
            0x94 | b'q' | b'r' => {
                let idx = match op {
                    0x94 => memo.len(),
                    b'q' => r.u8()? as usize,
                    _ => r.u32()?,
                };
                let top = stack
                    .last()
                    .ok_or_else(|| malformed(at, "stack underflow"))?;
                if matches!(top, Obj::Mark) {
                    return Err(malformed(at, "memoizing a MARK"));
                }
                memo.insert(idx, top.clone());
            }
            b'h' | b'j' => {
                let idx = if op == b'h' {
                    r.u8()? as usize
                } else {
                    r.u32()?
                };
                let v = memo
                    .get(&idx)
                    .ok_or_else(|| malformed(at, &format!("memo entry {idx} was never stored")))?;
                stack.push(v.clone())
            }
            b'0' => {
                pop(&mut stack)?;
            }
            _ => {
                return Err(PickleError::Opcode {
                    op,
                    name: opcode_name(op),
                    at,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_containers_and_shared_references() {
        // ([7], <the same list>) in protocol 4, a FRAME first: the list is memoized before
        // its APPEND, and the later BINGET sees the item.
        let mut p = vec![0x80, 4, 0x95];
        p.extend(9u64.to_le_bytes());
        p.extend([b'(', b']', 0x94, b'K', 7, b'a', b'h', 0, b't', b'.']);
        let list = Value::List(vec![Value::Int(7)]);
        assert_eq!(loads(&p).unwrap(), Value::Tuple(vec![list.clone(), list]));
        // {"a": b"xy", "b": (True, None, "é", -2, 300)}
        let mut p = vec![
            0x80, 4, b'}', 0x94, b'(', 0x8c, 1, b'a', b'C', 2, b'x', b'y',
        ];
        p.extend([0x8c, 1, b'b', b'(', 0x88, b'N', 0x8c, 2, 0xc3, 0xa9, b'J']);
        p.extend((-2i32).to_le_bytes());
        p.extend([b'M', 0x2c, 0x01, b't', b'u', b'.']);
        let v = loads(&p).unwrap();
        assert_eq!(v.get("a"), Some(&Value::Bytes(b"xy".to_vec())));
        let b = v.get("b").and_then(Value::as_seq).unwrap();
        assert_eq!(b[2].as_str(), Some("é"));
        assert_eq!((b[3].as_int(), b[4].as_int()), (Some(-2), Some(300)));
        // Two values left at STOP.
        assert!(matches!(
            loads(&[0x80, 4, b'N', b'N', b'.']),
            Err(PickleError::Malformed { .. })
        ));
    }

    #[test]
    fn long1_is_signed() {
        let p = [0x80, 2, 0x8a, 2, 0xff, 0xff, b'.'];
        assert_eq!(loads(&p).unwrap(), Value::Int(-1));
        let p = [0x80, 2, 0x8a, 8, 0, 0, 0, 0, 0, 0, 0, 1, b'.'];
        assert_eq!(loads(&p).unwrap(), Value::Int(1 << 56));
    }

    #[test]
    fn refuses_other_globals_and_opcodes() {
        let mut p = vec![0x80, 2, b'c'];
        p.extend(b"os\nsystem\n");
        p.extend([b')', b'R', b'.']);
        assert_eq!(
            loads(&p),
            Err(PickleError::Forbidden {
                module: "os".into(),
                name: "system".into()
            })
        );
        let p = [0x80, 4, 0x8f, b'.'];
        assert!(matches!(
            loads(&p),
            Err(PickleError::Opcode {
                name: "EMPTY_SET",
                ..
            })
        ));
        let p = [0x80, 4, b'X', 10, 0, 0, 0, b'a'];
        assert!(matches!(loads(&p), Err(PickleError::Truncated(_))));
        assert!(matches!(loads(&[0x80, 4]), Err(PickleError::Truncated(_))));
    }

    #[test]
    fn self_referential_lists_are_refused() {
        // l = []; l.append(l): MEMOIZE the list, GET it, APPEND it to itself.
        let p = [0x80, 4, b']', 0x94, b'h', 0, b'a', b'.'];
        assert!(matches!(loads(&p), Err(PickleError::TooLarge(_))));
    }
}
