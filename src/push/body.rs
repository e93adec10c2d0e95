//! A bucket's safetensors body as a list of chunks: the header, then each tensor's bytes. A
//! tensor sent as the checkpoint holds it is a slice of the checkpoint's memory map (no copy
//! into a fresh buffer, whose page faults cost the client more than the hashing did), and
//! hyper writes the chunks to the socket one after the other.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use safetensors::tensor::Dtype;
use serde_json::{json, Map, Value};

/// One tensor of a body: its name, dtype, shape and little-endian bytes.
pub struct BodyTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Bytes,
}

/// A request body of chunks with a known length (sent with `content-length`). Cloning shares
/// the chunks (a retry sends the same bytes again).
#[derive(Clone, Debug, Default)]
pub struct Chunks {
    chunks: VecDeque<Bytes>,
    len: u64,
}

impl Chunks {
    /// A body of one buffer.
    pub fn one(bytes: Bytes) -> Chunks {
        let len = bytes.len() as u64;
        Chunks {
            chunks: VecDeque::from([bytes]),
            len,
        }
    }

    /// The safetensors file of `tensors`, laid out as the `safetensors` crate writes one (its
    /// writer only makes one whole buffer, which is the copy this avoids):
    /// tensors of wider dtypes first (so each is aligned to its element), the header padded
    /// with spaces to a multiple of 8 bytes.
    pub fn safetensors(mut tensors: Vec<BodyTensor>) -> Result<Chunks, String> {
        tensors
            .sort_by(|a, b| (b.dtype.bitsize().cmp(&a.dtype.bitsize())).then(a.name.cmp(&b.name)));
        let mut header = Map::new();
        let mut offset = 0usize;
        for t in &tensors {
            let want = (t.shape.iter().product::<usize>() * t.dtype.bitsize()).div_ceil(8);
            if want != t.data.len() {
                return Err(format!(
                    "{}: {} bytes for a {:?} tensor of shape {:?} ({want} expected)",
                    t.name,
                    t.data.len(),
                    t.dtype,
                    t.shape
                ));
            }
            let dtype = serde_json::to_value(t.dtype).map_err(|e| e.to_string())?;
            header.insert(
                t.name.clone(),
                json!({"dtype": dtype, "shape": t.shape, "data_offsets": [offset, offset + want]}),
            );
            offset += want;
        }
        let mut text = serde_json::to_vec(&Value::Object(header)).map_err(|e| e.to_string())?;
        text.resize(text.len().next_multiple_of(8), b' ');
        let mut head = Vec::with_capacity(8 + text.len());
        head.extend_from_slice(&(text.len() as u64).to_le_bytes());
        head.extend_from_slice(&text);
        let mut chunks = VecDeque::with_capacity(1 + tensors.len());
        let len = (head.len() + offset) as u64;
        chunks.push_back(Bytes::from(head));
        chunks.extend(
            tensors
                .into_iter()
                .map(|t| t.data)
                .filter(|d| !d.is_empty()),
        );
        Ok(Chunks { chunks, len })
    }

    /// Bytes in the body.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole body in one buffer (tests, and callers that need contiguous bytes).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        self.chunks.iter().for_each(|c| out.extend_from_slice(c));
        out
    }
}

impl From<Bytes> for Chunks {
    fn from(bytes: Bytes) -> Chunks {
        Chunks::one(bytes)
    }
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let next = self.chunks.pop_front();
        if let Some(c) = &next {
            self.len -= c.len() as u64;
        }
        Poll::Ready(next.map(|c| Ok(Frame::data(c))))
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::SafeTensors;

    #[test]
    fn the_chunks_are_a_safetensors_file_of_the_tensors() {
        let t = |name: &str, dtype, shape: Vec<usize>, fill: u8| {
            let n = shape.iter().product::<usize>() * Dtype::bitsize(&dtype) / 8;
            BodyTensor {
                name: name.into(),
                dtype,
                shape,
                data: Bytes::from(
                    (0..n)
                        .map(|i| fill.wrapping_add(i as u8))
                        .collect::<Vec<_>>(),
                ),
            }
        };
        let tensors = vec![
            t("a.scales", Dtype::U8, vec![3, 5], 1),
            t("a.weight", Dtype::BF16, vec![3, 4], 7),
            t("b.s_dec", Dtype::F32, vec![1], 9),
            t("empty", Dtype::BF16, vec![0, 4], 0),
        ];
        let want: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.data.to_vec()))
            .collect();
        let body = Chunks::safetensors(tensors).unwrap();
        let bytes = body.to_vec();
        assert_eq!(bytes.len(), body.len());
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(header_len % 8, 0, "data starts 8-byte aligned");
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), want.len());
        for (name, dtype, shape, data) in &want {
            let v = st.tensor(name).unwrap();
            assert_eq!(
                (v.dtype(), v.shape(), v.data()),
                (*dtype, &shape[..], &data[..])
            );
            let at = v.data().as_ptr() as usize - bytes.as_ptr() as usize;
            assert_eq!(
                at % (dtype.bitsize() / 8),
                0,
                "{name} aligned to its element"
            );
        }

        let wrong = t("w", Dtype::BF16, vec![2, 2], 0);
        let short = BodyTensor {
            data: wrong.data.slice(..6),
            ..wrong
        };
        assert!(Chunks::safetensors(vec![short])
            .unwrap_err()
            .contains("w: 6 bytes"));
    }

    #[tokio::test]
    async fn the_body_streams_every_chunk_with_its_exact_length() {
        use http_body_util::BodyExt;
        let body = Chunks::safetensors(vec![BodyTensor {
            name: "x".into(),
            dtype: Dtype::F32,
            shape: vec![2],
            data: Bytes::from_static(&[0, 0, 128, 63, 0, 0, 0, 64]),
        }])
        .unwrap();
        let whole = body.to_vec();
        assert_eq!(body.size_hint().exact(), Some(whole.len() as u64));
        let got = body.clone().collect().await.unwrap().to_bytes();
        assert_eq!(&got[..], &whole[..]);
        // A retry sends the same bytes: the clone above left `body` whole.
        assert_eq!(body.to_vec(), whole);
    }
}
