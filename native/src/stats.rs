//! A checkpoint's records counted into the processor's ledger gauges (processors/kafka/reporting.py,
//! `LedgerStats`), compiled where the record's bytes decide alone:
//! - `count_audits` (`LedgerStats.count_audits`): the committed audit records of the current writer schema, each
//!   child's change of state moving it between the counts and each new `expired` counted as a lease expiry; any
//!   other audit record goes to the Python method (`_count_audit`) for that one record;
//! - `apply_ledger_changes` (`LedgerStats.apply`): a child that is neither deleted nor stranded (before or after)
//!   changes nothing there, and an open parent that stays open neither. Every other change (a deleted or stranded
//!   child, a parent that is not open before and after, a record of an older writer schema) goes to the Python
//!   method for that one change (`_change_child`, `_change_parent`), in its turn, so that the order of the changes
//!   and every count stay those of the Python loop.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySet, PyTuple};

/// The header of a single-object record: the marker (2 bytes) and the writer schema's fingerprint (8).
const HEADER: usize = 10;
const EXPIRED: &[u8] = b"expired";

/// The interned names of the states `_STATES` knows, by their bytes, read once per call.
struct Names<'py>(Vec<(Vec<u8>, Bound<'py, PyAny>)>);

impl<'py> Names<'py> {
    fn of(states: &Bound<'py, PyDict>) -> PyResult<Self> {
        let mut names = Vec::with_capacity(states.len());
        for (raw, name) in states.iter() {
            names.push((raw.downcast::<PyBytes>()?.as_bytes().to_vec(), name));
        }
        Ok(Names(names))
    }

    /// reporting._name: the interned name, or the bytes decoded (None: not UTF-8, for Python to decide).
    fn name(&self, py: Python<'py>, raw: &[u8]) -> Option<Bound<'py, PyAny>> {
        match self.0.iter().find(|(known, _)| known == raw) {
            Some((_, name)) => Some(name.clone()),
            None => std::str::from_utf8(raw).ok().map(|text| crate::new_str(py, text).into_any()),
        }
    }
}

/// For each audit record among `records` ((logical topic, key, value) triples), what `LedgerStats._count_audit`
/// does with it; returns the lease expiries counted (a child's, a parent's). `layout` is
/// `LedgerStats._audit_layout()`.
#[pyfunction]
pub fn count_audits(records: &Bound<'_, PyList>, layout: &Bound<'_, PyTuple>) -> PyResult<(i64, i64)> {
    let py = records.py();
    let topic = layout.get_item(0)?;
    let header: Vec<u8> = layout.get_item(1)?.extract()?;
    let names = Names::of(&layout.get_item(2)?.downcast_into()?)?;
    let children = layout.get_item(3)?.downcast_into::<PyDict>()?;
    let count_one = layout.get_item(4)?;
    let (mut child_expiries, mut parent_expiries) = (0i64, 0i64);
    // state -> what this call adds to its count, added to `children` once at the end (a record left to the
    // Python method changes `children` itself: the two sums commute)
    let mut deltas = Deltas(Vec::new());
    for record in records.iter() {
        let record = record.downcast_into::<PyTuple>()?;
        let logical = record.get_item(0)?;
        if !(logical.is(&topic) || logical.eq(&topic)?) {
            continue;
        }
        let value = record.get_item(2)?;
        let read = match value.downcast::<PyBytes>() {
            Ok(bytes) => transition(bytes.as_bytes(), &header),
            Err(_) => None,
        };
        let counted = match read {
            Some((is_child, prior, new)) => count(py, &names, &mut deltas, is_child, prior, new)?,
            None => None,
        };
        let (child, parent) = match counted {
            Some(expiries) => expiries,
            None => count_one.call1((&value,))?.extract()?,
        };
        child_expiries += child;
        parent_expiries += parent;
    }
    for (name, delta) in deltas.0 {
        add(&children, &name, delta)?;
    }
    Ok((child_expiries, parent_expiries))
}

/// Additions to the counts of states, by name.
struct Deltas<'py>(Vec<(Bound<'py, PyAny>, i64)>);

impl<'py> Deltas<'py> {
    fn add(&mut self, name: Bound<'py, PyAny>, delta: i64) -> PyResult<()> {
        // the names are the interned ones (Names) but for a state `_STATES` does not know
        let at = match self.0.iter().position(|(known, _)| known.is(&name)) {
            Some(at) => Some(at),
            None => {
                let mut found = None;
                for (at, (known, _)) in self.0.iter().enumerate() {
                    if known.eq(&name)? {
                        found = Some(at);
                        break;
                    }
                }
                found
            }
        };
        match at {
            Some(at) => self.0[at].1 += delta,
            None => self.0.push((name, delta)),
        }
        Ok(())
    }
}

/// `LedgerStats._count_audit` of a record read: the expiries; None (nothing changed) where a state is not UTF-8.
fn count<'py>(py: Python<'py>, names: &Names<'py>, deltas: &mut Deltas<'py>, is_child: bool, prior: &[u8],
              new: &[u8]) -> PyResult<Option<(i64, i64)>> {
    if prior == new {
        return Ok(Some((0, 0)));
    }
    if is_child {
        let leaves = if !prior.is_empty() && prior != EXPIRED {
            match names.name(py, prior) {
                Some(name) => Some(name),
                None => return Ok(None),
            }
        } else {
            None
        };
        let enters = if new != EXPIRED {
            match names.name(py, new) {
                Some(name) => Some(name),
                None => return Ok(None),
            }
        } else {
            None
        };
        if let Some(name) = leaves {
            deltas.add(name, -1)?;
        }
        if let Some(name) = enters {
            deltas.add(name, 1)?;
        }
    }
    Ok(Some(match (new == EXPIRED, is_child) {
        (false, _) => (0, 0),
        (true, true) => (1, 0),
        (true, false) => (0, 1),
    }))
}

/// reporting._Fields.transition for a record of the current writer schema `header`: (whether it is a child's,
/// its prior state, its new state); None where the Python reader must decide.
fn transition<'a>(data: &'a [u8], header: &[u8]) -> Option<(bool, &'a [u8], &'a [u8])> {
    if data.len() < HEADER || &data[2..HEADER] != header {
        return None;
    }
    let pos = skip(data, HEADER)?; // parent_id
    let (child_len, pos) = string(data, pos)?;
    let pos = skip(data, pos + child_len.len())?; // attempt_id
    let (branch, mut pos) = long(data, pos)?; // dimension: null or string
    if branch != 0 {
        pos = skip(data, pos)?;
    }
    let (branch, mut pos) = long(data, pos)?; // quantity: null or long
    if branch != 0 {
        pos = long(data, pos)?.1;
    }
    let (prior, pos) = string(data, pos)?;
    let (new, _) = string(data, pos + prior.len())?;
    Some((!child_len.is_empty(), prior, new))
}

/// The Avro string at `pos`: its bytes, and the position of its first byte.
fn string(data: &[u8], pos: usize) -> Option<(&[u8], usize)> {
    let (length, start) = long(data, pos)?;
    let end = start.checked_add(usize::try_from(length).ok()?)?;
    Some((data.get(start..end)?, start))
}

/// The position after the Avro string at `pos`.
fn skip(data: &[u8], pos: usize) -> Option<usize> {
    let (text, start) = string(data, pos)?;
    Some(start + text.len())
}

/// What the loop needs of a `LedgerStats`, read once per call: `layout` is `LedgerStats._layout()`.
struct Layout<'py> {
    child_kind: u8,
    parent_kind: u8,
    child_header: Vec<u8>,
    parent_header: Vec<u8>,
    stranded_state: Vec<u8>,
    open_status: Vec<u8>,
    stranded: Bound<'py, PyDict>, // stranded child key -> its remainders
    open: Bound<'py, PySet>,      // open parent keys
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
        stranded_state: layout.get_item(4)?.extract()?,
        open_status: layout.get_item(5)?.extract()?,
        stranded: layout.get_item(6)?.downcast_into()?,
        open: layout.get_item(7)?.downcast_into()?,
        change_child: layout.get_item(8)?,
        change_parent: layout.get_item(9)?,
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
            if !child_changes_nothing(&l, &key, &value)? {
                l.change_child.call1((&key, &value))?;
            }
        } else if kind == Some(l.parent_kind) && !parent_stays_open(&l, &key, &value)? {
            l.change_parent.call1((&key, &value))?;
        }
    }
    Ok(())
}

/// `LedgerStats._change_child` would change nothing: the child is written (not deleted), and stranded neither
/// before nor after.
fn child_changes_nothing<'py>(l: &Layout<'py>, key: &Bound<'py, PyAny>, value: &Bound<'py, PyAny>) -> PyResult<bool> {
    if value.is_none() || l.stranded.contains(key)? {
        return Ok(false);
    }
    let Ok(bytes) = value.downcast::<PyBytes>() else { return Ok(false) };
    Ok(match raw_state(bytes.as_bytes(), &l.child_header, 4) {
        Some(state) => state != l.stranded_state.as_slice(),
        None => false,
    })
}

/// An open parent written again as open: `_change_parent` would take it out of the open ones and put it back,
/// counting it -1 then +1, so nothing changes. True when that is the change.
fn parent_stays_open<'py>(l: &Layout<'py>, key: &Bound<'py, PyAny>, value: &Bound<'py, PyAny>) -> PyResult<bool> {
    if value.is_none() || !l.open.contains(key)? {
        return Ok(false);
    }
    let Ok(bytes) = value.downcast::<PyBytes>() else { return Ok(false) };
    Ok(raw_state(bytes.as_bytes(), &l.parent_header, 1) == Some(l.open_status.as_slice()))
}

/// The bytes of the state (or status) a record of the current writer schema holds after its first `strings`
/// strings (reporting._Fields: child_state skips 4, parent_status 1); None where the Python reader must decide.
fn raw_state<'a>(data: &'a [u8], header: &[u8], strings: usize) -> Option<&'a [u8]> {
    if data.len() < HEADER || &data[2..HEADER] != header {
        return None;
    }
    let mut pos = HEADER;
    for _ in 0..strings {
        pos = skip(data, pos)?;
    }
    Some(string(data, pos)?.0)
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
