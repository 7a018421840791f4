//! A checkpoint's ledger changes counted into the processor's ledger gauges (processors/kafka/reporting.py,
//! `LedgerStats.apply`), compiled for the changes the record's bytes decide alone: a child whose state moves
//! between the plain ones (new, settled, deleted, or from one unsettled state to another), and an open parent that
//! stays open. Everything else (a stranded child, whose remainders are kept; a parent that is not open before
//! and after; a record of an older writer schema; a state this code does not know) goes to the Python method
//! for that one change (`_change_child`, `_change_parent`), before anything of it has changed, so that the order of
//! the changes and every count stay those of the Python loop.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySet, PyString, PyTuple};

/// The header of a single-object record: the marker (2 bytes) and the writer schema's fingerprint (8).
const HEADER: usize = 10;

/// What the loop needs of a `LedgerStats`, read once per call: `layout` is `LedgerStats.compiled_layout()`.
struct Layout<'py> {
    child_kind: u8,
    parent_kind: u8,
    child_header: Vec<u8>,
    parent_header: Vec<u8>,
    states: Bound<'py, PyDict>,    // state bytes -> the interned state name (reporting._STATES)
    unsettled_states: Bound<'py, PyAny>, // a frozenset of names
    stranded: Bound<'py, PyString>,
    parent_open: Bound<'py, PyString>,
    unsettled: Bound<'py, PyDict>, // child key -> state
    open: Bound<'py, PySet>,       // open parent keys
    children: Bound<'py, PyDict>,  // state -> count
    store_get: Bound<'py, PyAny>,
    change_child: Bound<'py, PyAny>,
    change_parent: Bound<'py, PyAny>,
}

/// For each (key, value) of `changes`, in order, what `LedgerStats.apply` does with it.
#[pyfunction]
pub fn apply_ledger_changes(changes: &Bound<'_, PyList>, layout: &Bound<'_, PyTuple>) -> PyResult<()> {
    let l = Layout {
        child_kind: layout.get_item(0)?.extract()?,
        parent_kind: layout.get_item(1)?.extract()?,
        child_header: layout.get_item(2)?.extract()?,
        parent_header: layout.get_item(3)?.extract()?,
        states: layout.get_item(4)?.downcast_into()?,
        unsettled_states: layout.get_item(5)?,
        stranded: layout.get_item(6)?.downcast_into()?,
        parent_open: layout.get_item(7)?.downcast_into()?,
        unsettled: layout.get_item(8)?.downcast_into()?,
        open: layout.get_item(9)?.downcast_into()?,
        children: layout.get_item(10)?.downcast_into()?,
        store_get: layout.get_item(11)?,
        change_child: layout.get_item(12)?,
        change_parent: layout.get_item(13)?,
    };
    for change in changes.iter() {
        let change = change.downcast_into::<PyTuple>()?;
        let key = change.get_item(0)?;
        let value = change.get_item(1)?;
        let kind = match key.downcast::<PyBytes>() {
            Ok(bytes) => bytes.as_bytes().first().copied(),
            Err(_) => None,
        };
        if kind == Some(l.child_kind) {
            if !child(&l, &key, &value)? {
                l.change_child.call1((&key, &value))?;
            }
        } else if kind == Some(l.parent_kind) && !parent_stays_open(&l, &key, &value)? {
            l.change_parent.call1((&key, &value))?;
        }
    }
    Ok(())
}

/// `LedgerStats._change_child` where the bytes decide it; false (nothing changed): the Python method's to do.
fn child<'py>(l: &Layout<'py>, key: &Bound<'py, PyAny>, value: &Bound<'py, PyAny>) -> PyResult<bool> {
    let new = if value.is_none() {
        None
    } else {
        match state_of(l, value, &l.child_header, 4)? {
            Some(state) => Some(state),
            None => return Ok(false),
        }
    };
    let new_unsettled = match &new {
        Some(state) => l.unsettled_states.contains(state)?,
        None => false,
    };
    let mut old = l.unsettled.get_item(key)?;
    if old.is_none() && !new_unsettled {
        // not unsettled before: new, or settled (terminal); read the stored record to know which
        let stored = l.store_get.call1((key,))?;
        if !stored.is_none() {
            match state_of(l, &stored, &l.child_header, 4)? {
                Some(state) => old = Some(state),
                None => return Ok(false),
            }
        }
    }
    let is_stranded = |state: &Option<Bound<'py, PyAny>>| -> PyResult<bool> {
        Ok(match state {
            Some(state) => state.eq(&l.stranded)?,
            None => false,
        })
    };
    if is_stranded(&old)? || is_stranded(&new)? {
        return Ok(false); // its remainders are kept in Python
    }
    // LedgerStats._child, for states other than stranded
    if let Some(old) = &old {
        add(&l.children, old, -1)?;
    }
    if let Some(new) = &new {
        add(&l.children, new, 1)?;
    }
    if new_unsettled {
        l.unsettled.set_item(key, new.as_ref().expect("an unsettled state"))?;
    } else if old.is_some() && l.unsettled.contains(key)? {
        l.unsettled.del_item(key)?;
    }
    Ok(true)
}

/// An open parent written again as open: `_change_parent` would take it out of the open ones and put it back,
/// counting it -1 then +1, so nothing changes. True when that is the change.
fn parent_stays_open<'py>(l: &Layout<'py>, key: &Bound<'py, PyAny>, value: &Bound<'py, PyAny>) -> PyResult<bool> {
    if value.is_none() || !l.open.contains(key)? {
        return Ok(false);
    }
    Ok(match state_of(l, value, &l.parent_header, 1)? {
        Some(status) => status.eq(&l.parent_open)?,
        None => false,
    })
}

/// The state (or status) a record of the current writer schema holds after its first `strings` strings
/// (reporting._Fields: child_state skips 4, parent_status 1), as the interned name; None where the Python reader
/// must decide (another writer schema, bytes this code does not read, a state it does not know).
fn state_of<'py>(l: &Layout<'py>, value: &Bound<'py, PyAny>, header: &[u8], strings: usize)
                 -> PyResult<Option<Bound<'py, PyAny>>> {
    let Ok(bytes) = value.downcast::<PyBytes>() else { return Ok(None) };
    let data = bytes.as_bytes();
    if data.len() < HEADER || &data[2..HEADER] != header {
        return Ok(None);
    }
    let mut pos = HEADER;
    for _ in 0..strings {
        let Some((length, after)) = long(data, pos) else { return Ok(None) };
        if length < 0 {
            return Ok(None);
        }
        pos = after + length as usize;
    }
    let Some((length, after)) = long(data, pos) else { return Ok(None) };
    if length < 0 || after + length as usize > data.len() {
        return Ok(None);
    }
    let raw = PyBytes::new(value.py(), &data[after..after + length as usize]);
    l.states.get_item(raw)
}

/// An Avro long (zigzag varint) at `pos`, and the position after it; None past the end or beyond 64 bits.
fn long(data: &[u8], mut pos: usize) -> Option<(i64, usize)> {
    let mut n: u64 = 0;
    let mut shift = 0;
    loop {
        let b = *data.get(pos)?;
        pos += 1;
        if shift >= 64 {
            return None;
        }
        n |= u64::from(b & 0x7F) << shift;
        if b & 0x80 == 0 {
            break;
        }
        shift += 7;
    }
    Some((((n >> 1) as i64) ^ -((n & 1) as i64), pos))
}

/// `counts[state] = counts.get(state, 0) + delta`
fn add<'py>(counts: &Bound<'py, PyDict>, state: &Bound<'py, PyAny>, delta: i64) -> PyResult<()> {
    let before: i64 = match counts.get_item(state)? {
        Some(before) => before.extract()?,
        None => 0,
    };
    counts.set_item(state, before + delta)
}
