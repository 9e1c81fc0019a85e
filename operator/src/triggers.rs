//! Which routes a watch event on one route must reconcile. Pure: fed the route watch events
//! (after the reflector applied them) and a snapshot of the cache.
//!
//! A route is reconciled when its spec changes (a new `metadata.generation`; status writes
//! do not count, or the controller's own status writes would loop). Acceptance also depends
//! on the *other* routes of the namespace — the older route keeps a contested model — so a
//! change can flip a peer: a route sharing a model the changed route now claims may lose it,
//! and a route held back by a model the changed route claimed may win it once that route
//! is deleted or drops the model. So the routes of the namespace that share a model with
//! the changed route, before or after the change, are reconciled too. Without this a route
//! stayed `ModelConflict` (unpublished) after the route holding its model was deleted,
//! until the periodic resync minutes later.
//!
//! After a re-list (the watch restarted, e.g. the API server went away) routes whose
//! generation changed while the watch was down, and the peers of routes deleted meanwhile,
//! are reconciled once the whole list is in: only then does the cache hold it.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use kube::runtime::{reflector::ObjectRef, watcher::Event};
use tailwarden_crds::InferenceRoute;

/// A route's identity across incarnations: a route deleted and created again under the
/// same name is a new route (a new uid), whatever its generation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    namespace: Option<String>,
    name: String,
    uid: Option<String>,
}

impl Key {
    fn of(route: &InferenceRoute) -> Self {
        Self {
            namespace: route.metadata.namespace.clone(),
            name: route.metadata.name.clone().unwrap_or_default(),
            uid: route.metadata.uid.clone(),
        }
    }
}

/// What was last seen of a route.
#[derive(Debug, Clone)]
struct Seen {
    generation: Option<i64>,
    models: Vec<String>,
}

impl Seen {
    fn of(route: &InferenceRoute) -> Self {
        Self {
            generation: route.metadata.generation,
            models: route.spec.models.clone(),
        }
    }
}

/// A spec change: the route itself, and the models it claimed before and claims now.
struct Change {
    key: Key,
    reconcile_self: bool,
    models: Vec<String>,
}

/// Turns route watch events into the routes to reconcile.
#[derive(Debug, Default)]
pub struct RouteTriggers {
    seen: HashMap<Key, Seen>,
    /// During a re-list: the routes listed so far.
    relist: Option<HashMap<Key, Seen>>,
}

impl RouteTriggers {
    /// The routes to reconcile after `event`; `routes` is the cache *after* the event was
    /// applied to it (called at most once per event).
    pub fn on_event<F>(
        &mut self,
        event: &Event<InferenceRoute>,
        routes: F,
    ) -> Vec<ObjectRef<InferenceRoute>>
    where
        F: FnOnce() -> Vec<Arc<InferenceRoute>>,
    {
        let changes = match event {
            Event::Apply(route) => {
                let key = Key::of(route);
                let now = Seen::of(route);
                match self.seen.insert(key.clone(), now.clone()) {
                    Some(before) if before.generation == now.generation => Vec::new(),
                    before => vec![Change {
                        key,
                        reconcile_self: true,
                        models: union(before.map(|b| b.models), now.models),
                    }],
                }
            }
            Event::Delete(route) => {
                let key = Key::of(route);
                let before = self.seen.remove(&key).map(|b| b.models);
                vec![Change {
                    key,
                    reconcile_self: false,
                    models: union(before, route.spec.models.clone()),
                }]
            }
            Event::Init => {
                self.relist = Some(HashMap::new());
                Vec::new()
            }
            Event::InitApply(route) => {
                self.relist
                    .get_or_insert_with(HashMap::new)
                    .insert(Key::of(route), Seen::of(route));
                Vec::new()
            }
            Event::InitDone => {
                let listed = self.relist.take().unwrap_or_default();
                let mut changes = Vec::new();
                for (key, before) in &self.seen {
                    if !listed.contains_key(key) {
                        changes.push(Change {
                            key: key.clone(),
                            reconcile_self: false,
                            models: before.models.clone(),
                        });
                    }
                }
                for (key, now) in &listed {
                    let before = self.seen.get(key);
                    if before.is_none_or(|b| b.generation != now.generation) {
                        changes.push(Change {
                            key: key.clone(),
                            reconcile_self: true,
                            models: union(before.map(|b| b.models.clone()), now.models.clone()),
                        });
                    }
                }
                self.seen = listed;
                changes
            }
        };
        if changes.is_empty() {
            return Vec::new();
        }
        let routes = routes();
        let mut out: Vec<ObjectRef<InferenceRoute>> = Vec::new();
        let mut queued = HashSet::new();
        for change in &changes {
            if change.reconcile_self {
                let r = ObjectRef::new(&change.key.name);
                let r = match &change.key.namespace {
                    Some(ns) => r.within(ns),
                    None => r,
                };
                if queued.insert(r.clone()) {
                    out.push(r);
                }
            }
            for peer in routes.iter().filter(|p| {
                p.metadata.namespace == change.key.namespace
                    && p.metadata.name.as_deref() != Some(change.key.name.as_str())
                    && p.spec.models.iter().any(|m| change.models.contains(m))
            }) {
                let r = ObjectRef::from_obj(&**peer);
                if queued.insert(r.clone()) {
                    out.push(r);
                }
            }
        }
        out
    }
}

fn union(before: Option<Vec<String>>, now: Vec<String>) -> Vec<String> {
    let mut all = before.unwrap_or_default();
    for m in now {
        if !all.contains(&m) {
            all.push(m);
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(name: &str, uid: &str, generation: i64, models: &[&str]) -> InferenceRoute {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "tailwarden.io/v1alpha1", "kind": "InferenceRoute",
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "generation": generation},
            "spec": {"models": models, "providers": [{"name": "p", "baseUrl": "http://p/v1"}]},
        }))
        .unwrap()
    }

    fn names(refs: &[ObjectRef<InferenceRoute>]) -> Vec<&str> {
        refs.iter().map(|r| r.name.as_str()).collect()
    }

    fn cache(routes: &[&InferenceRoute]) -> Vec<Arc<InferenceRoute>> {
        routes.iter().map(|r| Arc::new((*r).clone())).collect()
    }

    #[test]
    fn own_spec_changes_trigger_and_status_writes_do_not() {
        let mut t = RouteTriggers::default();
        let a1 = route("a", "u1", 1, &["m"]);
        let out = t.on_event(&Event::Apply(a1.clone()), || cache(&[&a1]));
        assert_eq!(names(&out), ["a"]);
        assert_eq!(out[0].namespace.as_deref(), Some("ns"));
        // A status write: same generation, nothing to do (and no cache snapshot taken).
        let mut status_only = a1.clone();
        status_only.status = Some(Default::default());
        let out = t.on_event(&Event::Apply(status_only), || unreachable!());
        assert!(out.is_empty());
        let a2 = route("a", "u1", 2, &["m"]);
        let out = t.on_event(&Event::Apply(a2.clone()), || cache(&[&a2]));
        assert_eq!(names(&out), ["a"]);
        // Deleted and created again under the same name: a new route, generation 1 again.
        let out = t.on_event(&Event::Delete(a2), Vec::new);
        assert!(out.is_empty());
        let again = route("a", "u2", 1, &["m"]);
        let out = t.on_event(&Event::Apply(again.clone()), || cache(&[&again]));
        assert_eq!(names(&out), ["a"]);
    }

    #[test]
    fn routes_sharing_a_model_before_or_after_the_change_are_reconciled() {
        let mut t = RouteTriggers::default();
        let older = route("older", "u1", 1, &["shared", "x"]);
        let younger = route("younger", "u2", 1, &["shared"]);
        let other = route("other", "u3", 1, &["y"]);
        let all = [&older, &younger, &other];
        for r in all {
            t.on_event(&Event::Apply(r.clone()), || cache(&all));
        }
        // older drops "shared": younger may now have it.
        let older2 = route("older", "u1", 2, &["x"]);
        let out = t.on_event(&Event::Apply(older2.clone()), || {
            cache(&[&older2, &younger, &other])
        });
        assert_eq!(names(&out), ["older", "younger"]);
        // other starts claiming "shared": younger may lose it.
        let other2 = route("other", "u3", 2, &["y", "shared"]);
        let out = t.on_event(&Event::Apply(other2.clone()), || {
            cache(&[&older2, &younger, &other2])
        });
        assert_eq!(names(&out), ["other", "younger"]);
        // other is deleted: younger may win "shared" back; older shares nothing.
        let out = t.on_event(&Event::Delete(other2), || cache(&[&older2, &younger]));
        assert_eq!(names(&out), ["younger"]);
    }

    #[test]
    fn a_relist_reconciles_what_changed_and_the_peers_of_what_vanished() {
        let mut t = RouteTriggers::default();
        let holder = route("holder", "u1", 1, &["shared"]);
        let waiting = route("waiting", "u2", 1, &["shared"]);
        let steady = route("steady", "u3", 4, &["z"]);
        let edited = route("edited", "u4", 1, &["e"]);
        let all = [&holder, &waiting, &steady, &edited];
        for r in all {
            t.on_event(&Event::Apply(r.clone()), || cache(&all));
        }
        // While the watch was down: holder deleted, edited changed its spec.
        let edited2 = route("edited", "u4", 2, &["e"]);
        assert!(t.on_event(&Event::Init, || unreachable!()).is_empty());
        for r in [&waiting, &steady, &edited2] {
            assert!(
                t.on_event(&Event::InitApply(r.clone()), || unreachable!())
                    .is_empty()
            );
        }
        let mut out =
            names(&t.on_event(&Event::InitDone, || cache(&[&waiting, &steady, &edited2])))
                .into_iter()
                .map(str::to_owned)
                .collect::<Vec<_>>();
        out.sort();
        assert_eq!(out, ["edited", "waiting"]);
        // The cache now matches the list: a later status write of steady does nothing.
        assert!(
            t.on_event(&Event::Apply(steady.clone()), || unreachable!())
                .is_empty()
        );
    }
}
