//! A checkpoint's ledger changes put into a RocksDB write batch (projections/store.py, `RocksStore.write`),
//! compiled: the same `put` and `delete` calls on the batch, in the same order, without a Python frame per change.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

/// For each (key, value) of `changes`, in key order (a stable sort: of a key given twice, the value given last is
/// put last, so it is the one kept): `batch.delete(key)` where the value is None, else `batch.put(key, value)`.
/// The order `sorted(changes, key=itemgetter(0))` gives, sorted here over the keys' bytes (a key that is not bytes
/// raises TypeError, as the raw-mode batch's `put` does).
#[pyfunction]
pub fn fill_batch(py: Python<'_>, batch: &Bound<'_, PyAny>, changes: &Bound<'_, PyList>) -> PyResult<()> {
    let (put, delete) = (batch.getattr(intern!(py, "put"))?, batch.getattr(intern!(py, "delete"))?);
    let mut entries = Vec::with_capacity(changes.len());
    for change in changes.iter() {
        let change = change.downcast_into::<PyTuple>()?;
        let key = change.get_item(0)?;
        entries.push((key.downcast_into::<PyBytes>()?, change));
    }
    entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes())); // stable
    for (key, change) in entries {
        let value = change.get_item(1)?;
        if value.is_none() {
            delete.call1((key,))?;
        } else {
            put.call1((key, value))?;
        }
    }
    Ok(())
}
