//! The surface of stream serving, for the rest of the crate: the agent
//! answers the edge's streams in [`super::dispatch`] (by kind), forwards HTTP
//! in [`super::forward`] and pipes bytes in [`super::pipe`]. The HTTP
//! helpers the edge shares are in [`crate::http`].

pub use super::dispatch::{Resolver, Target, answer, fixed};
