//! The sending phase of a cycle, with no transaction open: the claimed jobs are sorted
//! (already in the ledger, on an unusable channel, a `sql` effect for the record
//! transaction, or a send on a remote channel: HTTP or NATS), and each send's outcome is
//! decided once it arrives (`flight`).

use super::claimed::{Channels, Job};
use super::decide::{self, Verdict};
use super::record::Outcomes;
use crate::channels::options::{ChannelOptions, Kind};
use crate::channels::remote::{Pending, Remotes, Sent};
use crate::channels::request;
use crate::classify::Class;
use crate::clock::now_ms;
use crate::gucs;
use crate::outbox::state::State;
use crate::random::SplitMix64;
use pgrx::prelude::*;

/// A claimed batch, sorted.
#[derive(Default)]
pub struct Sorted {
    /// Outcomes known without sending: the barrier, unusable channels, unsendable requests.
    pub outcomes: Outcomes,
    /// Jobs (by index) whose `sql` effect runs in the record transaction.
    pub effects: Vec<usize>,
    /// Jobs (by index) to send, with their send ready to run.
    pub requests: Vec<(usize, Pending<Sent>)>,
}

/// Sorts `jobs`: an effect already in the ledger is not sent again (the barrier); a job
/// whose channel is gone or cannot build its request fails; effects wait for the record
/// transaction; everything else becomes a send on its remote channel.
pub fn sort(
    remotes: &mut Remotes,
    channels: &Channels,
    jobs: &[Job],
    jitter: &mut SplitMix64,
) -> Sorted {
    let mut sorted = Sorted::default();
    for (i, job) in jobs.iter().enumerate() {
        if let Some((recorded_by, external_id)) = &job.ledger {
            sorted.outcomes.push_job(
                job,
                false,
                already_recorded(*recorded_by, external_id.clone()),
            );
            continue;
        }
        let Some(channel) = channels.by_id.get(&job.channel_id) else {
            let gone = format!("channel {} no longer exists", job.channel_id);
            sorted.outcomes.push_job(
                job,
                true,
                unusable_channel(Class::Permanent, State::Failed, gone),
            );
            continue;
        };
        if let Ok(ChannelOptions {
            kind: Kind::Sql { .. },
            ..
        }) = &channel.options
        {
            sorted.effects.push(i);
            continue;
        }
        if let Ok(options) = &channel.options {
            let ctx = job.context(now_ms());
            if let Some(v) =
                decide::before_republish(options, job.attempt, ctx, &mut || jitter.unit())
            {
                sorted.outcomes.push_job(job, true, v);
                continue;
            }
        }
        let built = channel
            .options
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|options| {
                let remote = remotes.channel(
                    job.channel_id,
                    &channel.version,
                    &channel.endpoint,
                    options,
                    super::flight::connections(gucs::batch_size()),
                )?;
                let message = request::Message {
                    channel_id: job.channel_id,
                    headers: job.headers.as_deref(),
                    payload: &job.payload,
                    effect_key: &job.effect_key,
                    fence: job.fence,
                };
                remote.prepare(&message, remotes.allowed())
            });
        match built {
            Ok(pending) => sorted.requests.push((i, pending)),
            Err(error) => sorted.outcomes.push_job(
                job,
                true,
                unusable_channel(Class::Permanent, State::Failed, error),
            ),
        }
    }
    sorted
}

/// Decides each send (retry policy, classification) into `outcomes`; a message that did
/// not end delivered or queued is said in the server log.
pub fn decide_all(
    channels: &Channels,
    jobs: &[Job],
    sent: &[(usize, Sent)],
    jitter: &mut SplitMix64,
    outcomes: &mut Outcomes,
) {
    let now = now_ms();
    for (i, t) in sent {
        let job = &jobs[*i];
        if t.fenced().is_some() {
            // Never started: back to the queue as it was, no attempt counted.
            outcomes.unsent.push(job.message_id);
            continue;
        }
        let Some(channel) = channels.by_id.get(&job.channel_id) else {
            continue;
        };
        let Ok(options) = &channel.options else {
            continue;
        };
        if let Some(ms) = t.elapsed_ms() {
            outcomes.observe_send(job.channel_id, ms);
        }
        let verdict = decide::after_send(t, options, job.context(now), &mut || jitter.unit());
        if verdict.state != State::Delivered && verdict.state != State::Queued {
            log!(
                "outbox_delivery: message {} on channel \"{}\" is {} after attempt {} ({}): {}",
                job.message_id,
                channel.name,
                verdict.state.as_str(),
                job.attempt,
                verdict.class.map(|c| c.as_str()).unwrap_or("-"),
                verdict.error.as_deref().unwrap_or("")
            );
        }
        outcomes.push_job(job, true, verdict);
    }
}

/// The verdict for an effect the ledger already holds: delivered, not sent again.
fn already_recorded(recorded_by: i64, external_id: Option<String>) -> Verdict {
    Verdict {
        state: State::Delivered,
        next_at_ms: None,
        class: None,
        http_status: None,
        retry_after_ms: None,
        external_id,
        error: None,
        outcome: format!("not sent: effect already in the ledger (message {recorded_by})"),
        settle_ms: None,
    }
}

/// A verdict for a message whose channel cannot be used (dropped, invalid options).
pub fn unusable_channel(class: Class, state: State, error: String) -> Verdict {
    Verdict {
        state,
        next_at_ms: None,
        class: Some(class),
        http_status: None,
        retry_after_ms: None,
        external_id: None,
        error: Some(error),
        outcome: class.as_str().to_string(),
        settle_ms: None,
    }
}
