//! The processor's per-message loop over a consumed batch (processors/kafka/processor.py, `Processor._fold`,
//! `PartitionTask.apply`, `Fold.apply`), compiled: decode, fold and buffer each message whose every step is the
//! plain one, and give the first message that is not back to the Python loop, before anything of it has changed.
//!
//! Plain means: no consumer error; a partition with a running task; an offset not folded yet; a value the
//! compiled decoder of its schema reads. Everything else (an error or end of partition, a message dropped as
//! redelivered, a record that may become a dead letter) is decided by `Processor._fold`, as without this loop.

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::fold::{Applied, FoldCore, Release};
use crate::outputs::{add_released, OutLists, OutputEncoder};
use crate::Decoder;

/// The loop stopped at a message the Python loop takes itself (or at the end of the batch).
const HANDED_BACK: i32 = 0;
/// The message before `next` left its partition with `commit_records` or more records buffered: checkpoint now.
const FULL: i32 = 1;
/// Folding (or buffering the outputs of) the message before `next` raised: stop its partition with that error.
const FAILED: i32 = 2;

/// One partition's task as the loop uses it, read from the tuple `PartitionTask.fast_parts` gives.
struct Parts<'py> {
    partition: i64,
    task: Bound<'py, PyAny>,
    fold: Bound<'py, PyAny>,
    core: Bound<'py, FoldCore>,
    out: Bound<'py, PyAny>,
    lists: OutLists<'py>, // out's, read once per call of `fold` (they are cleared in place, never replaced)
    encoder: Bound<'py, OutputEncoder>,
    // The task's, read once per call of `fold` (nothing else changes them meanwhile: a checkpoint, which replaces
    // `released`, runs only once `fold` returned) and written back before it returns.
    records: Bound<'py, PyList>,
    released: Bound<'py, PyDict>,
    stopped: bool,
    next_offset: i64,
    results: i64,
    position: Option<i64>,
}

impl Parts<'_> {
    /// The task's counters as this call of `fold` left them.
    fn write_back(&self) -> PyResult<()> {
        let py = self.task.py();
        self.task.setattr(intern!(py, "next_offset"), self.next_offset)?;
        if let Some(position) = self.position {
            self.task.setattr(intern!(py, "results"), self.results)?;
            self.task.setattr(intern!(py, "position"), position)?;
        }
        Ok(())
    }
}

#[pyclass(frozen, module = "branch_settlement_native")]
pub struct MessageFolder {
    readers: Py<PyDict>, // schema fingerprint -> the compiled Decoder of that event schema
    marker: Vec<u8>,
    header_size: usize,
    max_event_bytes: usize,
    commit_records: usize,
}

#[pymethods]
impl MessageFolder {
    #[classattr]
    const HANDED_BACK: i32 = HANDED_BACK;
    #[classattr]
    const FULL: i32 = FULL;
    #[classattr]
    const FAILED: i32 = FAILED;

    /// `readers`: fingerprint -> Decoder, the codec's compiled event readers (`Codec.compiled_event_readers`);
    /// `marker`, `header_size`: the single-object encoding's; `max_event_bytes`: the largest event
    /// (schemas/limits.py); `commit_records`: the buffered records at which the processor checkpoints at once.
    #[new]
    fn new(readers: &Bound<'_, PyDict>, marker: Vec<u8>, header_size: usize, max_event_bytes: usize,
           commit_records: usize) -> PyResult<Self> {
        for (fingerprint, reader) in readers.iter() {
            fingerprint.downcast::<PyBytes>()?;
            reader.downcast::<Decoder>()?;
        }
        if marker.len() > header_size {
            return Err(PyValueError::new_err("the marker is longer than the header"));
        }
        Ok(MessageFolder { readers: readers.clone().unbind(), marker, header_size, max_event_bytes, commit_records })
    }

    /// Fold `messages[start:]` while each is plain; `parts`: partition -> `PartitionTask.fast_parts()` of each
    /// task the loop may fold for; `counts`: result code -> events, added to. Returns (next, folded, status,
    /// task, error): `next` is the first message not taken; `folded` how many were folded; `status` HANDED_BACK,
    /// FULL or FAILED (then `task` is that message's task and, for FAILED, `error` what it raised).
    fn fold<'py>(&self, py: Python<'py>, messages: &Bound<'py, PyList>, start: usize, parts: &Bound<'py, PyDict>,
                 counts: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyTuple>> {
        let readers = self.readers.bind(py);
        let mut known: Vec<Parts<'py>> = Vec::new();
        let mut folded = 0usize;
        let none = py.None().into_bound(py);
        // result code -> events folded in this call, added to `counts` at the end
        let mut counted: Vec<(Bound<'py, PyAny>, i64)> = Vec::new();
        let done = |known: &[Parts<'py>], counted: &[(Bound<'py, PyAny>, i64)], next: usize, folded: usize,
                    status: i32, task: &Bound<'py, PyAny>, error: &Bound<'py, PyAny>| {
            for part in known {
                part.write_back()?;
            }
            for (code, n) in counted {
                let before: i64 = match counts.get_item(code)? {
                    Some(before) => before.extract()?,
                    None => 0,
                };
                counts.set_item(code, before + n)?;
            }
            PyTuple::new(py, [next.into_pyobject(py)?.into_any(), folded.into_pyobject(py)?.into_any(),
                              status.into_pyobject(py)?.into_any(), task.clone(), error.clone()])
        };
        let count = messages.len();
        let mut i = start;
        while i < count {
            let message = messages.get_item(i)?;
            if !message.call_method0(intern!(py, "error"))?.is_none() {
                break;
            }
            let partition: i64 = message.call_method0(intern!(py, "partition"))?.extract()?;
            let slot = match known.iter().position(|p| p.partition == partition) {
                Some(slot) => slot,
                None => {
                    let Some(given) = parts.get_item(partition)? else { break };
                    let given = given.downcast_into::<PyTuple>()?;
                    let task = given.get_item(0)?;
                    let (out, encoder) = (given.get_item(3)?, given.get_item(4)?.downcast_into::<OutputEncoder>()?);
                    known.push(Parts {
                        partition,
                        fold: given.get_item(1)?,
                        core: given.get_item(2)?.downcast_into::<FoldCore>()?,
                        lists: OutLists::of(&out, Some(encoder.get()))?,
                        out,
                        encoder,
                        records: task.getattr(intern!(py, "records"))?.downcast_into::<PyList>()?,
                        released: task.getattr(intern!(py, "released"))?.downcast_into::<PyDict>()?,
                        stopped: task.getattr(intern!(py, "stopped"))?.is_truthy()?,
                        next_offset: task.getattr(intern!(py, "next_offset"))?.extract()?,
                        results: task.getattr(intern!(py, "results"))?.extract()?,
                        position: None,
                        task,
                    });
                    known.len() - 1
                }
            };
            let part = &mut known[slot];
            if part.stopped {
                break;
            }
            let offset_object = message.call_method0(intern!(py, "offset"))?;
            let offset: i64 = offset_object.extract()?;
            if offset < part.next_offset {
                break;
            }
            let value = message.call_method0(intern!(py, "value"))?;
            let Some(event) = self.decode(py, readers, &value) else { break };
            part.next_offset = offset + 1;
            let part = &known[slot];
            let task = part.task.clone();
            // The result and the audit records of an event the core takes are written by the core at once, in their
            // routes' places around the outputs the encoder writes (the first route and the last).
            let direct = part.encoder.get().direct();
            let applied = match part.core.get().apply_with(py, &part.fold, event.as_any(), &offset_object, &part.out,
                                                           &part.lists, false, direct) {
                Ok(applied) => applied,
                Err(error) => return done(&known, &counted, i + 1, folded, FAILED, &task, error.value(py).as_any()),
            };
            let (records, released) = (&part.records, &part.released);
            let (code, audits) = match applied {
                Applied::Dict(result) => (result.get_item(intern!(py, "result"))?, Vec::new()),
                Applied::Direct { code, result: (key, value), releases, audits } => {
                    let direct = direct.expect("written directly only with a Direct");
                    records.append((direct.results_topic.bind(py), key, value))?;
                    if let Some(route) = &direct.releases {
                        // the second route's, then what the encoder writes of the others (as OutputEncoder.buffer)
                        for Release { record: (key, value), dimension, destination, quantity } in releases {
                            records.append((route.topic.bind(py), key, value))?;
                            add_released(released, dimension, destination.into_any(), quantity)?;
                        }
                    }
                    (code.into_any(), audits)
                }
            };
            if let Err(error) = part.encoder.get().buffer(py, &part.lists, records, released) {
                return done(&known, &counted, i + 1, folded, FAILED, &task, error.value(py).as_any());
            }
            if let Some(direct) = direct {
                for (key, value) in audits {
                    records.append((direct.audits_topic.bind(py), key, value))?;
                }
            }
            let full = records.len() + part.core.get().change_count(py) >= self.commit_records;
            let part = &mut known[slot];
            part.results += 1;
            part.position = Some(offset + 1);
            match counted.iter_mut().find(|(known, _)| known.is(&code) || known.eq(&code).unwrap_or(false)) {
                Some((_, n)) => *n += 1,
                None => counted.push((code, 1)),
            }
            folded += 1;
            i += 1;
            if full {
                return done(&known, &counted, i, folded, FULL, &task, &none);
            }
        }
        done(&known, &counted, i, folded, HANDED_BACK, &none, &none)
    }
}

impl MessageFolder {
    /// The event `Codec.decode_event` gives, where its compiled reader takes the value; None: let it decide.
    fn decode<'py>(&self, py: Python<'py>, readers: &Bound<'py, PyDict>, value: &Bound<'py, PyAny>)
                   -> Option<Bound<'py, PyDict>> {
        let data = value.downcast_exact::<PyBytes>().ok()?;
        let bytes = data.as_bytes();
        if bytes.len() > self.max_event_bytes || bytes.len() < self.header_size || !bytes.starts_with(&self.marker) {
            return None;
        }
        let fingerprint = PyBytes::new(py, &bytes[self.marker.len()..self.header_size]);
        let reader = readers.get_item(fingerprint).ok()??;
        let reader = reader.downcast_into::<Decoder>().ok()?;
        reader.get().__call__(py, data).ok()
    }
}
