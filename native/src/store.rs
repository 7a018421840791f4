//! A checkpoint's ledger changes put into a RocksDB write batch (projections/store.py, `RocksStore.write`),
//! compiled: the same `put` and `delete` calls on the batch, in the same order, without a Python frame per change.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

/// For each (key, value) of `changes`, in order: `batch.delete(key)` where the value is None, else
/// `batch.put(key, value)`.
#[pyfunction]
pub fn fill_batch(py: Python<'_>, batch: &Bound<'_, PyAny>, changes: &Bound<'_, PyList>) -> PyResult<()> {
    let (put, delete) = (batch.getattr(intern!(py, "put"))?, batch.getattr(intern!(py, "delete"))?);
    for change in changes.iter() {
        let change = change.downcast_into::<PyTuple>()?;
        let (key, value) = (change.get_item(0)?, change.get_item(1)?);
        if value.is_none() {
            delete.call1((key,))?;
        } else {
            put.call1((key, value))?;
        }
    }
    Ok(())
}
