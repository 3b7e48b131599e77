//! A list of small ints read straight from CPython's objects, with no call per item: the one part of the pick that
//! grew with the prompt at a Python call per token (vLLM hands its token ids over as a `list`).
//!
//! The stable ABI reads an item with two calls (`PyList_GetItem`, `PyLong_AsLong`); CPython's own
//! `array('I', list)` costs 6.5 ns an item, 26 µs for a 4,000-token prompt, where the whole pick costs less. This
//! module reads the list's item array and each `int`'s digit in place, about a nanosecond an item. It relies on
//! object layouts that CPython keeps but does not promise in its limited API, so it is used only where they were
//! checked:
//!
//! - a list (`PyListObject`) is its variable-size header, then the pointer to its items (CPython 3.0 to 3.14);
//! - an `int` of one 30-bit digit is the object header, then a word giving its size, then the digit. The word is
//!   the signed digit count up to 3.11 (`ob_size`: 0 for zero, 1 for one positive digit) and a tag from 3.12 on
//!   (`lv_tag`: bits 0–1 the sign, 0 positive and 1 zero; bit 2 the small-int flag of 3.14; the digit count from
//!   bit 3), CPython's `Include/cpython/longintrepr.h`.
//!
//! [`Reader::new`] picks the layout from the interpreter's version (CPython 3.11 to 3.14 on a 64-bit target, else
//! none) and then checks it against the API on a list of probe values, so a layout that differs turns the fast
//! path off instead of misreading. [`Reader::read`] accepts only exact `list`s whose items are all exact `int`s in
//! 0..2^30 (every token id of a real vocabulary) and declines anything else (a `bool`, an `int` subclass, a
//! negative or larger number), which the caller then reads through the API, with its error messages. The
//! interpreter is held throughout and no Python code runs during a read, so the list cannot change under it
//! (the stable ABI's wheels do not load in free-threaded builds).
#![allow(unsafe_code)]

use std::mem::size_of;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// Where an `int` keeps its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SizeWord {
    /// CPython 3.11: `ob_size`, the signed digit count.
    Signed,
    /// CPython 3.12 to 3.14: `lv_tag`, sign bits and the digit count shifted by 3.
    Tagged,
}

/// Bytes before a list's item pointer, and before an `int`'s size word and first digit.
const LIST_ITEMS: usize = size_of::<ffi::PyVarObject>();
const INT_SIZE_WORD: usize = size_of::<ffi::PyObject>();
const INT_DIGIT: usize = INT_SIZE_WORD + size_of::<usize>();

/// Reads lists of small ints in place, when this interpreter's layouts were checked.
#[derive(Debug, Clone, Copy)]
pub struct Reader {
    size_word: Option<SizeWord>,
}

impl Reader {
    /// The reader for this interpreter: its layout from the version, kept only if it reads probe values as the
    /// API does.
    pub fn new(py: Python<'_>) -> Self {
        let off = Self { size_word: None };
        let cpython = py
            .import("sys")
            .and_then(|sys| sys.getattr("implementation")?.getattr("name")?.extract::<String>())
            .is_ok_and(|name| name == "cpython");
        let version = py.version_info();
        let size_word = match (version.major, version.minor) {
            _ if !cpython || size_of::<usize>() != 8 => return off,
            (3, 11) => SizeWord::Signed,
            (3, 12..=14) => SizeWord::Tagged,
            _ => return off,
        };
        let reader = Self {
            size_word: Some(size_word),
        };
        if reader.agrees_with_the_api(py).unwrap_or(false) {
            reader
        } else {
            off
        }
    }

    /// Whether lists are read in place.
    pub fn enabled(&self) -> bool {
        self.size_word.is_some()
    }

    /// Appends the items of `list` to `out` and returns true if `list` is an exact list of exact ints in
    /// 0..2^30 and this reader is enabled; otherwise leaves `out` as it was and returns false.
    pub fn read(&self, list: &Bound<'_, PyList>, out: &mut Vec<u32>) -> bool {
        let Some(size_word) = self.size_word else {
            return false;
        };
        let start = out.len();
        let len = list.len();
        let list = list.as_ptr();
        let int_type = &raw mut ffi::PyLong_Type;
        // SAFETY: `list` is a live list (a `Bound` holds a reference, the interpreter is held) and, being an exact
        // list, has CPython's list layout: after its `PyVarObject` header, the pointer to its `len` items, each a
        // live object. Nothing runs Python code in the loop, so the list is not resized meanwhile.
        unsafe {
            if ffi::Py_TYPE(list) != &raw mut ffi::PyList_Type {
                return false;
            }
            let items = *list.cast::<u8>().add(LIST_ITEMS).cast::<*const *mut ffi::PyObject>();
            let mut declined = false;
            // One pass that writes every value (0 for an item declined), then the verdict: no early exit, so the
            // vector is filled without a capacity check per item.
            out.extend((0..len).map(|i| {
                let item = *items.add(i);
                // Only an exact `int` has the layout read here (and is a token id: not `True`).
                let value = if ffi::Py_TYPE(item) == int_type {
                    let word = *item.cast::<u8>().add(INT_SIZE_WORD).cast::<usize>();
                    match (size_word, word) {
                        (SizeWord::Signed, 0) => Some(0),
                        (SizeWord::Tagged, w) if w & 3 == 1 => Some(0),
                        // One digit, positive: its 30 bits are the value (the digit exists: size 1).
                        (SizeWord::Signed, 1) => Some(*item.cast::<u8>().add(INT_DIGIT).cast::<u32>()),
                        (SizeWord::Tagged, w) if w & 3 == 0 && w >> 3 == 1 => {
                            Some(*item.cast::<u8>().add(INT_DIGIT).cast::<u32>())
                        }
                        _ => None,
                    }
                } else {
                    None
                };
                value.unwrap_or_else(|| {
                    declined = true;
                    0
                })
            }));
            if declined {
                out.truncate(start);
                return false;
            }
        }
        true
    }

    /// Reads probe values (small ints, interned or not, up to the largest one-digit value) as the API does, and
    /// declines the values it must leave to the API.
    fn agrees_with_the_api(&self, py: Python<'_>) -> PyResult<bool> {
        let values: Vec<u32> = vec![0, 1, 5, 255, 256, 257, 1000, 65_535, 151_935, 1 << 29, (1 << 30) - 1];
        // Made by `int(str)`, so larger values are fresh objects rather than interned constants.
        let int = py.import("builtins")?.getattr("int")?;
        let fresh = values
            .iter()
            .map(|v| int.call1((v.to_string(),)))
            .collect::<PyResult<Vec<_>>>()?;
        let list = PyList::new(py, fresh)?;
        let mut out = Vec::new();
        if !self.read(&list, &mut out) || out != values {
            return Ok(false);
        }
        for declined in [c"[1, 1 << 30]", c"[-1]", c"[True]", c"[1 << 62]", c"[-(1 << 30)]"] {
            let list = py.eval(declined, None, None)?.cast_into::<PyList>()?;
            if self.read(&list, &mut out) || out != values {
                return Ok(false);
            }
        }
        Ok(true)
    }
}
