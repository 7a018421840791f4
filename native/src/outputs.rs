//! The outputs of one folded event, encoded as the processor buffers them: what `output_encoder`
//! (processors/ledger/outputs.py) does in Python, with the compiled writers called here instead of through Python.
//! A record a writer leaves to fastavro (NotPlain) is encoded by `Codec.encode`, as there.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

use crate::fold::{AUDIT_SLOTS, RELEASE_SLOTS, RESULT_SLOTS};
use crate::{Encoder, NotPlain, SlotOrder};

struct Route {
    attr: Py<PyString>,
    topic: Py<PyString>,
    name: Py<PyString>,
    encoder: Py<Encoder>,
}

/// `(out, records, released)`: each of `out`'s records, route by route, appended to `records` as (topic, the
/// parent id's UTF-8, the record's encoding); each release's quantity added to `released` under (dimension,
/// destination); then `out` cleared (its route lists, which are those Outputs.clear clears).
/// The key of an output record of `parent_id`: its UTF-8 (or whatever str.encode says of it).
pub(crate) fn output_key<'py>(parent_id: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    match parent_id.downcast::<PyString>().map(|id| id.to_str()) {
        Ok(Ok(id)) => Ok(PyBytes::new(parent_id.py(), id.as_bytes()).into_any()),
        _ => parent_id.call_method0(intern!(parent_id.py(), "encode")),
    }
}

#[pyclass(frozen, module = "branch_settlement_native")]
pub struct OutputEncoder {
    routes: Vec<Route>,
    encode: Py<PyAny>,
    direct: Option<Direct>,
}

/// The first route's records (results) and the last's (audit records), and the second's (releases) where it is that
/// route, as the compiled fold writes them itself for `settle run`'s loop (FoldCore::apply_with): encoded from its
/// values by these routes' writers, without a dict.
pub(crate) struct Direct {
    pub(crate) results_topic: Py<PyString>,
    pub(crate) result_name: Py<PyString>,
    pub(crate) result: Py<Encoder>,
    pub(crate) result_order: SlotOrder,
    pub(crate) audits_topic: Py<PyString>,
    pub(crate) audit_name: Py<PyString>,
    pub(crate) audit: Py<Encoder>,
    pub(crate) audit_order: SlotOrder,
    /// The releases' route, where it is the second (so that they go right after the result, before the encoder's).
    pub(crate) releases: Option<DirectRoute>,
    /// Codec.encode, for a record the writer leaves to fastavro
    pub(crate) encode: Py<PyAny>,
}

/// One more route whose records the compiled fold writes itself (Direct::releases).
pub(crate) struct DirectRoute {
    pub(crate) topic: Py<PyString>,
    pub(crate) name: Py<PyString>,
    pub(crate) encoder: Py<Encoder>,
    pub(crate) order: SlotOrder,
}

#[pymethods]
impl OutputEncoder {
    /// `routes`: (Outputs attribute, topic, record name, the compiled writer of that record) in the order
    /// outputs.OUTPUT_ROUTES gives; `encode`: Codec.encode, for what a writer leaves to fastavro.
    #[new]
    fn new(routes: &Bound<'_, PyList>, encode: Py<PyAny>) -> PyResult<Self> {
        let mut built = Vec::new();
        for route in routes.iter() {
            let route = route.downcast::<PyTuple>()?;
            built.push(Route {
                attr: route.get_item(0)?.downcast_into::<PyString>()?.unbind(),
                topic: route.get_item(1)?.downcast_into::<PyString>()?.unbind(),
                name: route.get_item(2)?.downcast_into::<PyString>()?.unbind(),
                encoder: route.get_item(3)?.downcast_into::<Encoder>()?.unbind(),
            });
        }
        let direct = Self::direct_routes(routes.py(), &built, &encode);
        Ok(OutputEncoder { routes: built, encode, direct })
    }

    pub(crate) fn __call__(&self, py: Python<'_>, out: &Bound<'_, PyAny>, records: &Bound<'_, PyList>,
                released: &Bound<'_, PyDict>) -> PyResult<()> {
        self.buffer(py, &OutLists::of(out, Some(self))?, records, released)
    }
}

/// An `Outputs`' lists, read once (`settle run`'s loop reads them once per consumed batch and partition: the lists
/// are cleared in place, never replaced): the four the core appends to, and those of the encoder's routes in their
/// order.
pub(crate) struct OutLists<'py> {
    pub(crate) results: Bound<'py, PyList>,
    pub(crate) releases: Bound<'py, PyList>,
    pub(crate) settled: Bound<'py, PyList>,
    pub(crate) audits: Bound<'py, PyList>,
    routes: Vec<Bound<'py, PyList>>,
}

impl<'py> OutLists<'py> {
    pub(crate) fn of(out: &Bound<'py, PyAny>, encoder: Option<&OutputEncoder>) -> PyResult<Self> {
        let py = out.py();
        let list = |name: &Bound<'py, PyString>| -> PyResult<Bound<'py, PyList>> {
            Ok(out.getattr(name)?.downcast_into::<PyList>()?)
        };
        let (results, releases) = (list(intern!(py, "results"))?, list(intern!(py, "releases"))?);
        let (settled, audits) = (list(intern!(py, "settled"))?, list(intern!(py, "audits"))?);
        let mut routes = Vec::new();
        for route in encoder.map(|e| e.routes.as_slice()).unwrap_or(&[]) {
            let attr = route.attr.bind(py);
            routes.push(match attr.to_str()? {
                "results" => results.clone(),
                "releases" => releases.clone(),
                "settled" => settled.clone(),
                "audits" => audits.clone(),
                _ => list(attr)?,
            });
        }
        Ok(OutLists { results, releases, settled, audits, routes })
    }
}

impl OutputEncoder {
    /// `__call__` with `out`'s lists read already (`lists` of this encoder's routes).
    pub(crate) fn buffer(&self, py: Python<'_>, lists: &OutLists<'_>, records: &Bound<'_, PyList>,
                         released: &Bound<'_, PyDict>) -> PyResult<()> {
        let mut buffer = Vec::new();
        let mut taken = Vec::new();
        for (route, list) in self.routes.iter().zip(&lists.routes) {
            if list.is_empty() {
                continue;
            }
            if buffer.capacity() == 0 {
                buffer.reserve(512);
            }
            taken.push(list.clone());
            let encoder = route.encoder.get();
            for record in list.iter() {
                let key = output_key(&record.get_item(intern!(py, "parent_id"))?)?;
                let value = match encoder.encode_with(py, &record, &mut buffer) {
                    Ok(bytes) => bytes.into_any(),
                    Err(NotPlain) => self.encode.bind(py).call1((route.name.bind(py), &record))?,
                };
                records.append((route.topic.bind(py), key, value))?;
            }
            if route.attr.bind(py).to_str()? == "releases" {
                for release in list.iter() {
                    add_released(released, release.get_item(intern!(py, "dimension"))?,
                                 release.get_item(intern!(py, "destination"))?,
                                 release.get_item(intern!(py, "quantity"))?)?;
                }
            }
        }
        // Outputs.clear: the routes name every list it clears; those that were empty are left as they are.
        for list in taken {
            list.del_slice(0, list.len())?;
        }
        Ok(())
    }
}

/// A release's quantity added to `released` under (dimension, destination).
pub(crate) fn add_released<'py>(released: &Bound<'py, PyDict>, dimension: Bound<'py, PyAny>,
                                destination: Bound<'py, PyAny>, quantity: Bound<'py, PyAny>) -> PyResult<()> {
    let key = (dimension, destination);
    let total = match released.get_item(&key)? {
        Some(before) => before.add(quantity)?,
        None => quantity,
    };
    released.set_item(key, total)
}

impl OutputEncoder {
    /// Direct, where the results are the first route and the audit records the last (so that the records the
    /// compiled fold writes itself keep the routes' order around those of the other routes), and both writers
    /// find a slot for every field of their records.
    fn direct_routes(py: Python<'_>, routes: &[Route], encode: &Py<PyAny>) -> Option<Direct> {
        let (first, last) = (routes.first()?, routes.last()?);
        if first.attr.bind(py).to_str().ok()? != "results" || last.attr.bind(py).to_str().ok()? != "audits" {
            return None;
        }
        let releases = routes.get(1).filter(|route| route.attr.bind(py).to_str().ok() == Some("releases"))
            .and_then(|route| Some(DirectRoute {
                topic: route.topic.clone_ref(py),
                name: route.name.clone_ref(py),
                order: route.encoder.get().slot_order(py, &RELEASE_SLOTS)?,
                encoder: route.encoder.clone_ref(py),
            }));
        Some(Direct {
            results_topic: first.topic.clone_ref(py),
            result_name: first.name.clone_ref(py),
            result_order: first.encoder.get().slot_order(py, &RESULT_SLOTS)?,
            result: first.encoder.clone_ref(py),
            audits_topic: last.topic.clone_ref(py),
            audit_name: last.name.clone_ref(py),
            audit_order: last.encoder.get().slot_order(py, &AUDIT_SLOTS)?,
            audit: last.encoder.clone_ref(py),
            releases,
            encode: encode.clone_ref(py),
        })
    }

    pub(crate) fn direct(&self) -> Option<&Direct> {
        self.direct.as_ref()
    }
}
