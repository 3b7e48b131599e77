//! The gateway's routing policies: per worker role (aggregated; under disaggregation, prefill and decode, each
//! with its own config), the default one, for requests that name no model (or a fleet whose models are unknown),
//! and one per model served, built on first use from the same config, since what a prompt did on one model says
//! nothing of another. Read without a lock; a new model's policy is added under a lock and swapped in. A part of
//! the state that features take on their own (the KV event feeds deliver to every policy here).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use dprouter_core::{Policy, PolicyConfig};

use crate::config::{GatewayConfig, Role};

pub struct Policies {
    /// Per role ([`Role::ALL`]'s order), its config and its default policy.
    roles: [(PolicyConfig, Arc<dyn Policy>); 3],
    by_model: ArcSwap<HashMap<(Role, String), Arc<dyn Policy>>>,
    adding: Mutex<()>,
}

fn index(role: Role) -> usize {
    match role {
        Role::Aggregated => 0,
        Role::Prefill => 1,
        Role::Decode => 2,
    }
}

impl Policies {
    /// The policies of `config`'s `[routing]`, `[prefill_routing]` and `[decode_routing]`.
    pub fn new(config: &GatewayConfig) -> Self {
        let built = |c: &PolicyConfig| (c.clone(), Arc::from(c.build()));
        Self {
            roles: Role::ALL.map(|role| built(config.routing_of(role))),
            by_model: Default::default(),
            adding: Mutex::new(()),
        }
    }

    /// The policy of (aggregated) requests that name no model.
    /// The sessions active at `now_us` at each of `snap`'s endpoints, by rank, over every policy that keeps them.
    pub fn sessions_by_rank(&self, snap: &dprouter_core::Snapshot, now_us: u64) -> Vec<usize> {
        let mut out = vec![0; snap.len()];
        let by_model = self.by_model.load();
        let policies = self.roles.iter().map(|(_, p)| p).chain(by_model.values());
        for counts in policies.filter_map(|p| p.sessions_by_rank(snap, now_us)) {
            for (total, n) in out.iter_mut().zip(counts) {
                *total += n;
            }
        }
        out
    }

    pub fn default_policy(&self) -> &Arc<dyn Policy> {
        self.role_default(Role::Aggregated)
    }

    /// The policy of requests that name no model, on workers with `role`.
    pub fn role_default(&self, role: Role) -> &Arc<dyn Policy> {
        &self.roles[index(role)].1
    }

    /// The policy for (aggregated) requests of `model` (the served name, after aliases): its own, or the default
    /// one for no model.
    pub fn for_model(&self, model: Option<&str>) -> Arc<dyn Policy> {
        self.for_role(Role::Aggregated, model)
    }

    /// The policy for requests of `model` on workers with `role`.
    pub fn for_role(&self, role: Role, model: Option<&str>) -> Arc<dyn Policy> {
        let Some(model) = model else {
            return Arc::clone(self.role_default(role));
        };
        let key = (role, model.to_string());
        if let Some(policy) = self.by_model.load().get(&key) {
            return Arc::clone(policy);
        }
        let _adding = self.adding.lock().unwrap_or_else(|e| e.into_inner());
        let mut policies = self.by_model.load().as_ref().clone();
        let config = &self.roles[index(role)].0;
        let policy = Arc::clone(policies.entry(key).or_insert_with(|| Arc::from(config.build())));
        self.by_model.store(Arc::new(policies));
        policy
    }
}
