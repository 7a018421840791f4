//! A checkpoint's records handed to the producer (processors/kafka/checkpoint.py, `_produce_all` and `_produce`),
//! compiled: the same `Producer.produce` calls, in the same order, without a Python frame per record.

use pyo3::exceptions::PyBufferError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

/// Produce `records` to partition `partition`: (logical topic, key, value) triples, each to `topics[logical]`;
/// or, with `topic` given, (key, value) pairs, each to `topic`. `report`: the indexes of the records produced with
/// `on_delivery` (ascending), or None for every record; with `last_of_each_topic`, the last record of each
/// topic the records go to (checkpoint._last_of_each_topic: found here, from the end). A full local queue
/// (BufferError) polls 50 ms and tries the same record again, as `_produce` does. Returns None, or (index, error)
/// for the record whose produce raised anything else: the caller says which record it was and raises the error.
#[pyfunction]
#[pyo3(signature = (producer, records, partition, report, on_delivery, topics=None, topic=None,
                    last_of_each_topic=false))]
#[allow(clippy::too_many_arguments)]
pub fn produce_records<'py>(py: Python<'py>, producer: &Bound<'py, PyAny>, records: &Bound<'py, PyList>,
                            partition: &Bound<'py, PyAny>, report: Option<Vec<usize>>, on_delivery: &Bound<'py, PyAny>,
                            topics: Option<&Bound<'py, PyDict>>, topic: Option<&Bound<'py, PyAny>>,
                            last_of_each_topic: bool) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let produce = producer.getattr(intern!(py, "produce"))?;
    let report = if last_of_each_topic { Some(last_of_each(records)?) } else { report };
    let mut reported = report.as_deref().unwrap_or(&[]).iter().peekable();
    for (n, record) in records.iter().enumerate() {
        let record = record.downcast_into::<PyTuple>()?;
        let (target, key, value) = match topic {
            Some(topic) => (topic.clone(), record.get_item(0)?, record.get_item(1)?),
            None => {
                let topics = topics.expect("topics or topic");
                let logical = record.get_item(0)?;
                let Some(target) = topics.get_item(&logical)? else {
                    return Err(pyo3::exceptions::PyKeyError::new_err(logical.unbind()));
                };
                (target, record.get_item(1)?, record.get_item(2)?)
            }
        };
        let with_report = match &report {
            None => true,
            Some(_) => {
                while reported.next_if(|&&r| r < n).is_some() {}
                reported.next_if_eq(&&n).is_some()
            }
        };
        loop {
            let outcome = if with_report {
                produce.call1((&target, &value, &key, partition, on_delivery))
            } else {
                produce.call1((&target, &value, &key, partition))
            };
            match outcome {
                Ok(_) => break,
                Err(err) if err.is_instance_of::<PyBufferError>(py) => {
                    // the local queue is full: let deliveries drain
                    producer.call_method1(intern!(py, "poll"), (0.05,))?;
                }
                Err(err) => {
                    let index = n.into_pyobject(py)?.into_any();
                    return Ok(Some(PyTuple::new(py, [index, err.into_value(py).into_bound(py).into_any()])?));
                }
            }
        }
    }
    Ok(None)
}

/// The indexes (ascending) of the last of `records` ((logical topic, key, value) triples) of each topic.
fn last_of_each(records: &Bound<'_, PyList>) -> PyResult<Vec<usize>> {
    let mut seen: Vec<Bound<'_, PyAny>> = Vec::new();
    let mut last = Vec::new();
    for n in (0..records.len()).rev() {
        let topic = records.get_item(n)?.downcast_into::<PyTuple>()?.get_item(0)?;
        let mut known = false;
        for other in &seen {
            if other.is(&topic) || other.eq(&topic)? {
                known = true;
                break;
            }
        }
        if !known {
            seen.push(topic);
            last.push(n);
        }
    }
    last.reverse();
    Ok(last)
}
