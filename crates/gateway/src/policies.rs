//! The gateway's routing policies: the default one, for requests that name no model (or a fleet whose models are
//! unknown), and one per model served, built on first use from the same config, since what a prompt did on one
//! model says nothing of another. Read without a lock; a new model's policy is added under a lock and swapped in.
//! A part of the state that features take on their own (the KV event feeds deliver to every policy here).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use dprouter_core::{Policy, PolicyConfig};

pub struct Policies {
    config: PolicyConfig,
    default: Arc<dyn Policy>,
    by_model: ArcSwap<HashMap<String, Arc<dyn Policy>>>,
    adding: Mutex<()>,
}

impl Policies {
    pub fn new(config: &PolicyConfig) -> Self {
        Self {
            config: config.clone(),
            default: Arc::from(config.build()),
            by_model: Default::default(),
            adding: Mutex::new(()),
        }
    }

    /// The policy of requests that name no model.
    pub fn default_policy(&self) -> &Arc<dyn Policy> {
        &self.default
    }

    /// The policy for requests of `model` (the served name, after aliases): its own, or the default one for no
    /// model.
    pub fn for_model(&self, model: Option<&str>) -> Arc<dyn Policy> {
        let Some(model) = model else {
            return Arc::clone(&self.default);
        };
        if let Some(policy) = self.by_model.load().get(model) {
            return Arc::clone(policy);
        }
        let _adding = self.adding.lock().unwrap_or_else(|e| e.into_inner());
        let mut policies = self.by_model.load().as_ref().clone();
        let policy = Arc::clone(
            policies
                .entry(model.to_string())
                .or_insert_with(|| Arc::from(self.config.build())),
        );
        self.by_model.store(Arc::new(policies));
        policy
    }
}
