//! Typed kernel arguments: what Rust values may stand for each [`Param`] kind, and a launch's
//! argument tuple, whose kinds [`Gpu::launch`](super::Gpu::launch) checks against the kernel's
//! declaration (`Kernel::params`) before queuing it.
//!
//! A pointer parameter takes a [`View`] (a buffer and the elements the kernel touches, made by
//! the ops' size check, or [`View::whole`] where the extent depends on data the caller checks),
//! an `Option<View>` (null when absent) or, for offsets into a buffer, a raw [`DevPtr`].
//! Scalars are `i32`, `u64` and `f32`, so `n as u64` for an `int` parameter is caught at launch.
//! A [`TensorMap`] goes by value (the TMA GEMM's).

use cudarc::driver::{CudaSlice, DevicePtr};

use super::device::Gpu;
use super::kernels::Param;

/// The most parameters a kernel may have (the widest, the GEMMs, take 27).
pub const MAX_PARAMS: usize = 27;

/// One argument as the driver receives it.
#[derive(Clone, Copy, Debug)]
pub enum Raw {
    U64(u64),
    I32(i32),
    F32(f32),
    /// A tensor map's 128 bytes.
    Map([u64; 16]),
}

/// A tensor map (`CUtensorMap`) for the TMA unit, encoded on the host
/// (`ops::gemm`'s `tensor_map`) and passed by value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorMap(pub [u64; 16]);

/// A device buffer as a kernel argument: `len` elements of `buf`, the extent the launch may
/// touch (checked by the op that made it).
pub struct View<'a, T> {
    buf: &'a CudaSlice<T>,
    len: usize,
}

// Not derived: that would require `T: Clone`.
impl<T> Clone for View<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for View<'_, T> {}

impl<'a, T> View<'a, T> {
    /// The first `len` elements; `None` when the buffer holds fewer.
    pub fn prefix(buf: &'a CudaSlice<T>, len: usize) -> Option<View<'a, T>> {
        (buf.len() >= len).then_some(View { buf, len })
    }

    /// All of `buf`: for buffers a kernel indexes through data (block tables, routing plans),
    /// whose bounds the caller keeps.
    pub fn whole(buf: &'a CudaSlice<T>) -> View<'a, T> {
        View {
            buf,
            len: buf.len(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its device address.
    pub fn addr(&self, gpu: &Gpu) -> u64 {
        addr(gpu, self.buf)
    }
}

/// The device address of a buffer (event tracking is off, so the guard does nothing).
pub fn addr<T>(gpu: &Gpu, s: &CudaSlice<T>) -> u64 {
    let (p, _sync) = s.device_ptr(&gpu.stream);
    p
}

/// A raw device address, for a pointer into a buffer at an offset the caller computed; 0 is
/// null.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevPtr(pub u64);

/// A value for one kernel parameter of kind [`KernelArg::KIND`].
pub trait KernelArg {
    const KIND: Param;
    fn raw(&self, gpu: &Gpu) -> Raw;
}

impl KernelArg for i32 {
    const KIND: Param = Param::I32;
    fn raw(&self, _: &Gpu) -> Raw {
        Raw::I32(*self)
    }
}

impl KernelArg for u64 {
    const KIND: Param = Param::U64;
    fn raw(&self, _: &Gpu) -> Raw {
        Raw::U64(*self)
    }
}

impl KernelArg for f32 {
    const KIND: Param = Param::F32;
    fn raw(&self, _: &Gpu) -> Raw {
        Raw::F32(*self)
    }
}

impl KernelArg for TensorMap {
    const KIND: Param = Param::TensorMap;
    fn raw(&self, _: &Gpu) -> Raw {
        Raw::Map(self.0)
    }
}

impl KernelArg for DevPtr {
    const KIND: Param = Param::Ptr;
    fn raw(&self, _: &Gpu) -> Raw {
        Raw::U64(self.0)
    }
}

impl<T> KernelArg for View<'_, T> {
    const KIND: Param = Param::Ptr;
    fn raw(&self, gpu: &Gpu) -> Raw {
        Raw::U64(self.addr(gpu))
    }
}

impl<T> KernelArg for Option<View<'_, T>> {
    const KIND: Param = Param::Ptr;
    fn raw(&self, gpu: &Gpu) -> Raw {
        Raw::U64(self.map_or(0, |v| v.addr(gpu)))
    }
}

/// A launch's arguments: a tuple of [`KernelArg`]s, their kinds in order.
pub trait KernelArgs {
    const KINDS: &'static [Param];
    /// Writes the arguments into `out`, in order.
    fn raw(&self, gpu: &Gpu, out: &mut [Raw; MAX_PARAMS]);
}

macro_rules! tuple_args {
    ($($t:ident $i:tt),+) => {
        impl<$($t: KernelArg),+> KernelArgs for ($($t,)+) {
            const KINDS: &'static [Param] = &[$($t::KIND),+];
            fn raw(&self, gpu: &Gpu, out: &mut [Raw; MAX_PARAMS]) {
                $(out[$i] = self.$i.raw(gpu);)+
            }
        }
    };
}

tuple_args!(A 0);
tuple_args!(A 0, B 1);
tuple_args!(A 0, B 1, C 2);
tuple_args!(A 0, B 1, C 2, D 3);
tuple_args!(A 0, B 1, C 2, D 3, E 4);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14, P 15);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14, P 15, Q 16);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14, P 15, Q 16, R 17);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14, P 15, Q 16, R 17, S 18);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14, P 15, Q 16, R 17, S 18, T 19);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14, P 15, Q 16, R 17, S 18, T 19, U 20);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14, P 15, Q 16, R 17, S 18, T 19, U 20, V 21);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14, P 15, Q 16, R 17, S 18, T 19, U 20, V 21, W 22);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14, P 15, Q 16, R 17, S 18, T 19, U 20, V 21, W 22, X 23);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14, P 15, Q 16, R 17, S 18, T 19, U 20, V 21, W 22, X 23, Y 24);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14, P 15, Q 16, R 17, S 18, T 19, U 20, V 21, W 22, X 23, Y 24, Z 25);
tuple_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11, M 12, N 13, O 14, P 15, Q 16, R 17, S 18, T 19, U 20, V 21, W 22, X 23, Y 24, Z 25, AA 26);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernels::Kernel;

    #[test]
    fn argument_tuples_carry_their_kinds_in_order() {
        type Fill = (DevPtr, u64, u64, f32);
        assert_eq!(Fill::KINDS, Kernel::DummyFillBf16.params());
        type Wrong = (DevPtr, i32, u64, f32);
        assert_ne!(Wrong::KINDS, Kernel::DummyFillBf16.params());
        type Maybe<'a> = (Option<View<'a, f32>>, View<'a, u8>, i32);
        assert_eq!(Maybe::KINDS, [Param::Ptr, Param::Ptr, Param::I32]);
    }

    #[test]
    fn no_kernel_takes_more_than_the_tuples_hold() {
        for k in Kernel::ALL {
            assert!(k.params().len() <= MAX_PARAMS, "{k:?}");
        }
    }
}
