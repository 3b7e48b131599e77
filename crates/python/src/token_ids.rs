//! A prompt's token ids from Python: a list of ints (vLLM's form), a buffer of 32- or 64-bit integers
//! (`array('q')`, SGLang's form; `array('i')`, numpy), or any other iterable of ints, into a vector of `u32`.
//!
//! A list of small ints is read in place ([`crate::small_ints`]); a buffer is copied out of its memory (64-bit ids
//! into a scratch vector the thread keeps) and each id checked once. Anything else, and a list the fast reader declines (an id of 2^30 or
//! more, a `bool`, an item that is not an int), goes through CPython's `array('I', list)`, whose errors name the
//! bad item.

use pyo3::buffer::{Element, PyBuffer, PyUntypedBuffer};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyList;

use crate::small_ints::Reader;
use crate::DprouterError;

/// This interpreter's in-place list reader, made (and checked) once.
pub fn reader(py: Python<'_>) -> Reader {
    static READER: PyOnceLock<Reader> = PyOnceLock::new();
    *READER.get_or_init(py, || Reader::new(py))
}

thread_local! {
    /// The 64-bit ids of the last buffer read on this thread, kept for the next.
    static SCRATCH: std::cell::RefCell<Vec<i64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Reads `obj`'s token ids into a new vector.
pub fn read(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let py = obj.py();
    let mut out = Vec::new();
    if let Ok(list) = obj.cast::<PyList>() {
        if reader(py).read(list, &mut out) {
            return Ok(out);
        }
        return list_by_array(list);
    }
    // One buffer request, its element type told by its format (a failed typed request costs an exception).
    if let Ok(buffer) = PyUntypedBuffer::get(obj) {
        let format = buffer.format();
        let kind = [Kind::U32, Kind::I64, Kind::I32, Kind::U64]
            .into_iter()
            .find(|kind| kind.fits(&buffer, format));
        match kind {
            // An empty array's memory may be a one-byte placeholder, not aligned for its type: nothing to read.
            Some(_) if buffer.item_count() == 0 => return Ok(out),
            Some(Kind::U32) => {
                let buffer = buffer.as_typed::<u32>()?;
                out.resize(buffer.item_count(), 0);
                buffer.copy_to_slice(py, &mut out)?;
                return Ok(out);
            }
            // `array('q')`, SGLang's form, through a scratch vector kept by the thread.
            Some(Kind::I64) => SCRATCH.with_borrow_mut(|scratch| convert(py, buffer.as_typed()?, &mut out, scratch))?,
            Some(Kind::I32) => convert::<i32>(py, buffer.as_typed()?, &mut out, &mut Vec::new())?,
            Some(Kind::U64) => convert::<u64>(py, buffer.as_typed()?, &mut out, &mut Vec::new())?,
            None => {}
        }
        if kind.is_some() {
            return Ok(out);
        }
    }
    let items = obj.try_iter().map_err(|_| {
        DprouterError::new_err("token_ids must be a list of ints or a buffer of 32- or 64-bit integers")
    })?;
    items.map(|item| token_id(&item?)).collect()
}

/// The integer types a buffer of token ids may hold.
#[derive(Debug, Clone, Copy)]
enum Kind {
    U32,
    I64,
    I32,
    U64,
}

impl Kind {
    /// Whether `buffer`, of `format`, holds elements of this type.
    fn fits(self, buffer: &PyUntypedBuffer, format: &std::ffi::CStr) -> bool {
        fn of<T: Element>(buffer: &PyUntypedBuffer, format: &std::ffi::CStr) -> bool {
            buffer.item_size() == std::mem::size_of::<T>() && T::is_compatible_format(format)
        }
        match self {
            Kind::U32 => of::<u32>(buffer, format),
            Kind::I64 => of::<i64>(buffer, format),
            Kind::I32 => of::<i32>(buffer, format),
            Kind::U64 => of::<u64>(buffer, format),
        }
    }
}

/// A list through CPython's own loop (`array('I', list)`), then its buffer.
fn list_by_array(list: &Bound<'_, PyList>) -> PyResult<Vec<u32>> {
    let py = list.py();
    static ARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let array = ARRAY.get_or_try_init(py, || py.import("array")?.getattr("array").map(Bound::unbind))?;
    let unsigned = array
        .bind(py)
        .call1(("I", list))
        .map_err(|e| DprouterError::new_err(format!("token_ids must hold ints in 0..2^32 ({e})")))?;
    PyBuffer::<u32>::get(&unsigned)?.to_vec(py)
}

/// An integer type token ids come in, besides `u32`.
trait WideId: Element + Copy + Default + std::fmt::Display {
    /// The bits above the low 32 (all set for a negative value): 0 for an id in 0..2^32.
    fn high(self) -> u64;
    fn low(self) -> u32;
}

macro_rules! wide_id {
    ($($t:ty),*) => {$(
        impl WideId for $t {
            fn high(self) -> u64 {
                (self as i64 as u64) >> 32
            }
            fn low(self) -> u32 {
                self as u32
            }
        }
    )*};
}
wide_id!(i64, i32);

impl WideId for u64 {
    fn high(self) -> u64 {
        self >> 32
    }
    fn low(self) -> u32 {
        self as u32
    }
}

/// The ids in `buffer`, copied out of its memory into `scratch` (CPython's copy: another thread may write to a
/// buffer while this one reads it, which Rust code may not do in place) and narrowed in one pass that vectorizes.
fn convert<T: WideId>(py: Python<'_>, buffer: &PyBuffer<T>, out: &mut Vec<u32>, scratch: &mut Vec<T>) -> PyResult<()> {
    // Resized, not cleared: the copy overwrites every element, so only new ones are filled.
    scratch.resize(buffer.item_count(), T::default());
    buffer.copy_to_slice(py, scratch)?;
    narrow(scratch.iter().copied(), out)
}

/// Appends `ids` to `out` as `u32`s, in one pass, or fails naming the first one outside 0..2^32 (`out` then holds
/// what it had).
fn narrow<T: WideId>(ids: impl Iterator<Item = T> + Clone, out: &mut Vec<u32>) -> PyResult<()> {
    let start = out.len();
    let mut high = 0;
    out.extend(ids.clone().map(|t| {
        high |= t.high();
        t.low()
    }));
    if high != 0 {
        out.truncate(start);
        let bad = ids.into_iter().find(|t| t.high() != 0).unwrap_or_default();
        return Err(DprouterError::new_err(format!("token id {bad} is not in 0..2^32")));
    }
    Ok(())
}

fn token_id(item: &Bound<'_, PyAny>) -> PyResult<u32> {
    item.extract::<u32>().or_else(|_| match item.extract::<i64>() {
        Ok(value) => {
            u32::try_from(value).map_err(|_| DprouterError::new_err(format!("token id {value} is not in 0..2^32")))
        }
        Err(_) => Err(DprouterError::new_err("token_ids must hold ints")),
    })
}
