//! The sending phase of a cycle, with no transaction open: the claimed jobs are sorted
//! (already in the ledger, on an unusable channel, a `sql` effect for the record
//! transaction, or a request), the requests are sent together, and each answer is decided.

use super::claim::{Channels, Job};
use super::decide::{self, Verdict};
use super::record::Outcomes;
use crate::channels::http::{self, Outgoing, Transport};
use crate::channels::options::{ChannelOptions, Kind};
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
    /// Jobs (by index) to send, with their client and request.
    pub requests: Vec<(usize, reqwest::Client, Outgoing)>,
}

/// Sorts `jobs`: an effect already in the ledger is not sent again (the barrier); a job
/// whose channel is gone or cannot build its request fails; effects wait for the record
/// transaction; everything else becomes a request.
pub fn sort(transport: &mut Transport, channels: &Channels, jobs: &[Job]) -> Sorted {
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
        let built = channel
            .options
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|options| {
                let client = transport.client(
                    job.channel_id,
                    &channel.version,
                    options,
                    gucs::batch_size(),
                )?;
                let message = request::Message {
                    channel_id: job.channel_id,
                    headers: job.headers.as_deref(),
                    payload: &job.payload,
                    effect_key: &job.effect_key,
                };
                let mut out = request::outgoing(&message, &channel.endpoint, options)?;
                if let Some(signing) = &options.signing {
                    let now_s = (now_ms() / 1000) as u64;
                    signing.sign(
                        &mut out.headers,
                        &job.effect_key,
                        now_s,
                        out.body.as_bytes(),
                    );
                }
                Ok((client, out))
            });
        match built {
            Ok((client, out)) => sorted.requests.push((i, client, out)),
            Err(error) => sorted.outcomes.push_job(
                job,
                true,
                unusable_channel(Class::Permanent, State::Failed, error),
            ),
        }
    }
    sorted
}

/// Sends the requests together on `runtime`; returns each job's index with what happened.
pub fn send(
    runtime: &tokio::runtime::Runtime,
    transport: &Transport,
    requests: Vec<(usize, reqwest::Client, Outgoing)>,
) -> Vec<(usize, http::Transmission)> {
    let order: Vec<usize> = requests.iter().map(|(i, _, _)| *i).collect();
    let transmissions = http::transmit_all(
        runtime,
        requests
            .into_iter()
            .map(|(_, client, out)| (client, out))
            .collect(),
        transport.allowed(),
    );
    order.into_iter().zip(transmissions).collect()
}

/// Decides each transmission (retry policy, classification) into `outcomes`; a message that
/// did not end delivered or queued is said in the server log.
pub fn decide_all(
    channels: &Channels,
    jobs: &[Job],
    sent: &[(usize, http::Transmission)],
    jitter: &mut SplitMix64,
    outcomes: &mut Outcomes,
) {
    let now = now_ms();
    for (i, t) in sent {
        let job = &jobs[*i];
        let Some(channel) = channels.by_id.get(&job.channel_id) else {
            continue;
        };
        let Ok(options) = &channel.options else {
            continue;
        };
        let verdict =
            decide::after_transmission(t, options, job.context(now), &mut || jitter.unit());
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
    }
}
