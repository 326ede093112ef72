//! What the demo prints: a header, a line per phase, the table with both
//! phases side by side, and the last line `duplicates: naive=<n>
//! idemstore=<m>`; or, with `--json`, one JSON object with every figure.

use std::io::{self, Write};
use std::time::Duration;

use serde_json::json;

use super::Args;

/// What one phase did.
#[derive(Debug, Clone)]
pub struct Phase {
    /// Ticket intents, over all agents.
    pub intents: u64,
    /// Requests the agents sent, retries included.
    pub attempts: u64,
    /// Attempts that got no answer within the client timeout.
    pub timeouts: u64,
    /// Intents the agents gave up on after `--max-attempts`.
    pub gave_up: u64,
    /// Intents whose final answer was replayed from the store.
    pub replayed_intents: u64,
    /// Tickets the service created, late requests included.
    pub tickets: u64,
    /// Tickets created minus distinct intents that got one.
    pub duplicates: u64,
    /// Answers the service replayed from the store.
    pub replays: u64,
    /// "Busy, retry after" answers the service gave.
    pub in_progress: u64,
    /// Claims that took over a lapsed lease.
    pub takeovers: u64,
    /// Takeovers that found the earlier holder's ticket by key.
    pub found_by_lookup: u64,
    /// Service workers that died after creating a ticket.
    pub crashes: u64,
    /// Completions refused because the worker's lease had been taken over.
    pub stale_completions: u64,
    /// From the first agent's start to the last agent's last answer.
    pub wall: Duration,
}

impl Phase {
    /// One line when the phase ends: `<label> ... <seconds> s`.
    pub fn write_progress(&self, out: &mut dyn Write, label: &str) -> io::Result<()> {
        writeln!(out, "{label:<28}{:>8.2} s", self.wall.as_secs_f64())?;
        out.flush()
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "intents": self.intents,
            "attempts": self.attempts,
            "timeouts": self.timeouts,
            "gave_up": self.gave_up,
            "tickets_created": self.tickets,
            "duplicates": self.duplicates,
            "replays": self.replays,
            "replayed_intents": self.replayed_intents,
            "in_progress_answers": self.in_progress,
            "takeovers": self.takeovers,
            "found_by_lookup": self.found_by_lookup,
            "worker_crashes": self.crashes,
            "stale_completions": self.stale_completions,
            "wall_ms": self.wall.as_secs_f64() * 1000.0,
        })
    }
}

/// How a table row shows one phase.
type Cell = fn(&Phase) -> String;

/// The whole run: its settings and both phases.
#[derive(Debug)]
pub struct Report<'a> {
    args: &'a Args,
    run_id: &'a str,
    /// The naive phase, once run.
    pub naive: Option<Phase>,
    /// The idemstore phase, once run.
    pub idemstore: Option<Phase>,
}

impl<'a> Report<'a> {
    /// A report of a run with `args` and `run_id`, no phase run yet.
    pub fn new(args: &'a Args, run_id: &'a str) -> Report<'a> {
        Report {
            args,
            run_id,
            naive: None,
            idemstore: None,
        }
    }

    /// What is about to run, in four lines and a blank one.
    pub fn write_header(&self, out: &mut dyn Write) -> io::Result<()> {
        let a = self.args;
        writeln!(
            out,
            "idemstore demo: {} agents x {} ticket intents, run id {}, seed {}",
            a.agents, a.intents, self.run_id, a.seed
        )?;
        writeln!(
            out,
            "  link:    {} of responses lost, {} of attempts late (past the {} ms client timeout)",
            percent(a.drop_rate),
            percent(a.late_rate),
            a.timeout_ms
        )?;
        writeln!(
            out,
            "  service: {}-{} ms per request, {} of workers die after creating the ticket",
            a.latency_ms / 2,
            a.latency_ms + a.latency_ms / 2,
            percent(a.crash_rate)
        )?;
        writeln!(
            out,
            "  store:   {}, lease {} ms",
            a.file.display(),
            a.lease_ms
        )?;
        writeln!(out)?;
        out.flush()
    }

    /// The table, a note on what it shows, and the last line.
    pub fn write_table(&self, out: &mut dyn Write) -> io::Result<()> {
        let (Some(naive), Some(idem)) = (&self.naive, &self.idemstore) else {
            return Ok(());
        };
        let rows: [(&str, Cell); 11] = [
            ("intents", |p| p.intents.to_string()),
            ("attempts", |p| p.attempts.to_string()),
            ("timeouts", |p| p.timeouts.to_string()),
            ("tickets created", |p| p.tickets.to_string()),
            ("duplicates", |p| p.duplicates.to_string()),
            ("replays", |p| p.replays.to_string()),
            ("in-progress answers", |p| p.in_progress.to_string()),
            ("worker crashes", |p| p.crashes.to_string()),
            ("takeovers (found by key)", |p| {
                format!("{} ({})", p.takeovers, p.found_by_lookup)
            }),
            ("gave up", |p| p.gave_up.to_string()),
            ("wall time", |p| format!("{:.2} s", p.wall.as_secs_f64())),
        ];
        writeln!(out)?;
        writeln!(out, "{:<26}{:>14}{:>14}", "", "naive", "idemstore")?;
        for (label, cell) in rows {
            writeln!(out, "{label:<26}{:>14}{:>14}", cell(naive), cell(idem))?;
        }
        writeln!(out)?;
        writeln!(out, "What each row counts:")?;
        for (label, meaning) in LEGEND {
            writeln!(out, "  {label:<26}{meaning}")?;
        }
        writeln!(out)?;
        writeln!(out, "{}", attempts_note(naive, idem))?;
        writeln!(out)?;
        if idem.tickets == 0 && idem.replayed_intents == idem.intents {
            writeln!(
                out,
                "Every intent was replayed from {} and no ticket was created: \
                 the file, not the process, remembers.",
                self.args.file.display()
            )?;
        } else {
            writeln!(
                out,
                "Run again with --run-id {} to send the same keys: the idemstore phase \
                 will replay every intent from the file.",
                self.run_id
            )?;
        }
        writeln!(
            out,
            "duplicates: naive={} idemstore={}",
            naive.duplicates, idem.duplicates
        )?;
        out.flush()
    }

    /// One JSON object: the settings, both phases, and the duplicates.
    pub fn write_json(&self, out: &mut dyn Write) -> io::Result<()> {
        let a = self.args;
        let value = json!({
            "run_id": self.run_id,
            "file": a.file.display().to_string(),
            "settings": {
                "agents": a.agents,
                "intents_per_agent": a.intents,
                "seed": a.seed,
                "drop_rate": a.drop_rate,
                "late_rate": a.late_rate,
                "crash_rate": a.crash_rate,
                "latency_ms": a.latency_ms,
                "timeout_ms": a.timeout_ms,
                "lease_ms": a.lease_ms,
                "max_attempts": a.max_attempts,
            },
            "naive": self.naive.as_ref().map(Phase::json),
            "idemstore": self.idemstore.as_ref().map(Phase::json),
            "duplicates": {
                "naive": self.naive.as_ref().map(|p| p.duplicates),
                "idemstore": self.idemstore.as_ref().map(|p| p.duplicates),
            },
        });
        serde_json::to_writer_pretty(&mut *out, &value).map_err(io::Error::from)?;
        writeln!(out)?;
        out.flush()
    }
}

/// One line per row of the table, in its order: what the figure counts.
const LEGEND: [(&str, &str); 12] = [
    (
        "intents",
        "tickets wanted: agents x intents, one idempotency key each",
    ),
    ("attempts", "requests sent, retries included"),
    (
        "timeouts",
        "no answer within the client timeout (lost, late, or the worker died)",
    ),
    (
        "tickets created",
        "tickets the service wrote, late requests included",
    ),
    ("duplicates", "tickets created beyond one per intent"),
    (
        "replays",
        "answers from the store; the work did not run (a lost one is retried)",
    ),
    (
        "in-progress answers",
        "\"busy, retry after\": another attempt held the key's lease",
    ),
    (
        "worker crashes",
        "workers that died after creating a ticket (only acquired claims create)",
    ),
    (
        "takeovers (found by key)",
        "N (M): N claims took over a dead worker's lapsed lease; M of them",
    ),
    (
        "",
        "found its ticket by key instead of creating one (naive: no leases)",
    ),
    ("gave up", "intents dropped after --max-attempts"),
    (
        "wall time",
        "from the first agent's start to the last answer",
    ),
];

/// Why the two phases' attempt counts differ, a few lines of at most 92
/// characters. More attempts: every "busy" answer is an attempt that did
/// no work and is retried, and each attempt draws its own fate, so later
/// fates shift. Fewer attempts: only the causes the two phases' figures
/// show: more naive intents that gave up after `--max-attempts`, more
/// naive worker crashes (a replayed or busy answer creates no ticket, so
/// it cannot crash); when neither, fewer timeouts, or else the shifted
/// fates.
fn attempts_note(naive: &Phase, idem: &Phase) -> String {
    let text = match idem.attempts.cmp(&naive.attempts) {
        std::cmp::Ordering::Greater => format!(
            "Why idemstore needs more attempts ({} vs {}): its {} in-progress answers are \
             attempts that did no work and were retried after their retry_after (the naive \
             service never answers busy: it creates another ticket). Each retry draws its own \
             fate from the seeded link, so the lost and late attempts after it shift too.",
            idem.attempts, naive.attempts, idem.in_progress
        ),
        std::cmp::Ordering::Equal => format!("Both phases made {} attempts.", idem.attempts),
        std::cmp::Ordering::Less => {
            // Each cause the figures show, first letter lowercase; the
            // first follows the colon, the others are capitalized.
            let mut causes = Vec::new();
            let gave_up = naive.gave_up > idem.gave_up;
            let crashed = naive.crashes > idem.crashes;
            if gave_up {
                causes.push(format!(
                    "intents that got no answer within --max-attempts attempts gave up, each \
                     after using all of them (gave up: {} naive, {} idemstore).",
                    naive.gave_up, idem.gave_up
                ));
            }
            if crashed {
                causes.push(format!(
                    "each worker crash leaves an attempt unanswered and retried (worker \
                     crashes: {} naive, {} idemstore); with idemstore only an acquired claim \
                     creates a ticket and can crash, so a replayed or busy attempt the seed \
                     meant to crash was answered instead.",
                    naive.crashes, idem.crashes
                ));
            }
            if !gave_up && !crashed {
                causes.push(if idem.timeouts < naive.timeouts {
                    format!(
                        "an agent retries after every timeout, and idemstore's attempts met \
                         fewer (timeouts: {} naive, {} idemstore).",
                        naive.timeouts, idem.timeouts
                    )
                } else {
                    "each agent draws every attempt's fate in turn from the seeded link, so \
                     once its attempts differ between the phases, its later attempts meet \
                     other fates."
                        .to_owned()
                });
            }
            if idem.in_progress > 0 {
                causes.push(format!(
                    "its {} in-progress answers were retried, and each retry draws its own \
                     fate from the seeded link.",
                    idem.in_progress
                ));
            }
            let mut text = format!(
                "Why idemstore needs fewer attempts ({} vs {}):",
                idem.attempts, naive.attempts
            );
            for (i, cause) in causes.iter().enumerate() {
                text.push(' ');
                let mut chars = cause.chars();
                match chars.next() {
                    Some(first) if i > 0 => {
                        text.extend(first.to_uppercase());
                        text.push_str(chars.as_str());
                    }
                    _ => text.push_str(cause),
                }
            }
            text
        }
    };
    wrap(&text, 92)
}

/// `text` with its spaces replaced by newlines so that no line is longer
/// than `width` characters (a longer word stays whole).
fn wrap(text: &str, width: usize) -> String {
    let mut out = String::new();
    let mut line = 0;
    for word in text.split_whitespace() {
        let len = word.chars().count();
        if line > 0 && line + 1 + len > width {
            out.push('\n');
            line = 0;
        } else if line > 0 {
            out.push(' ');
            line += 1;
        }
        out.push_str(word);
        line += len;
    }
    out
}

/// `0.2` as `20%`.
fn percent(rate: f64) -> String {
    format!("{}%", (rate * 100.0 * 100.0).round() / 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A phase of 512 intents, every one answered at its first attempt.
    fn phase() -> Phase {
        Phase {
            intents: 512,
            attempts: 512,
            timeouts: 0,
            gave_up: 0,
            replayed_intents: 0,
            tickets: 512,
            duplicates: 0,
            replays: 0,
            in_progress: 0,
            takeovers: 0,
            found_by_lookup: 0,
            crashes: 0,
            stale_completions: 0,
            wall: Duration::from_secs(1),
        }
    }

    fn assert_lines_fit(note: &str) {
        for line in note.lines() {
            assert!(line.chars().count() <= 92, "{line:?} in {note}");
        }
    }

    /// Every naive attempt timed out and every naive intent gave up; no
    /// worker crashed (`--crash-rate 0`): the note names the intents that
    /// gave up and says nothing of crashes.
    #[test]
    fn fewer_attempts_with_no_crash_names_the_intents_that_gave_up() {
        let naive = Phase {
            attempts: 25_600,
            timeouts: 25_600,
            gave_up: 512,
            ..phase()
        };
        let idem = Phase {
            attempts: 4_274,
            timeouts: 3_760,
            in_progress: 18,
            ..phase()
        };
        let note = attempts_note(&naive, &idem);
        assert_lines_fit(&note);
        let text = note.replace('\n', " ");
        assert!(
            text.starts_with("Why idemstore needs fewer attempts (4274 vs 25600):"),
            "{text}"
        );
        assert!(text.contains("gave up: 512 naive, 0 idemstore"), "{text}");
        assert!(!text.contains("crash"), "{text}");
        assert!(text.contains("Its 18 in-progress answers"), "{text}");
        assert!(
            text.contains("(4274 vs 25600): intents that got no answer"),
            "{text}"
        );
    }

    /// Every attempt replayed (a second run with the same keys): the naive
    /// workers' crashes explain the difference; nothing gave up.
    #[test]
    fn fewer_attempts_with_crashes_names_the_crashes_only() {
        let naive = Phase {
            attempts: 755,
            timeouts: 243,
            crashes: 14,
            ..phase()
        };
        let idem = Phase {
            attempts: 738,
            timeouts: 226,
            replays: 738,
            ..phase()
        };
        let note = attempts_note(&naive, &idem);
        assert_lines_fit(&note);
        let text = note.replace('\n', " ");
        assert!(
            text.contains("worker crashes: 14 naive, 0 idemstore"),
            "{text}"
        );
        assert!(!text.contains("gave up"), "{text}");
        assert!(!text.contains("in-progress"), "{text}");
    }

    /// Neither more naive intents gave up nor more naive workers crashed:
    /// the note falls back on the timeouts each phase met.
    #[test]
    fn fewer_attempts_otherwise_names_the_timeouts() {
        let naive = Phase {
            attempts: 600,
            timeouts: 88,
            crashes: 3,
            ..phase()
        };
        let idem = Phase {
            attempts: 590,
            timeouts: 78,
            crashes: 3,
            ..phase()
        };
        let text = attempts_note(&naive, &idem).replace('\n', " ");
        assert!(text.contains("timeouts: 88 naive, 78 idemstore"), "{text}");
        assert!(!text.contains("crash"), "{text}");
        assert!(!text.contains("gave up"), "{text}");
    }

    #[test]
    fn more_or_equal_attempts_keep_their_notes() {
        let naive = Phase {
            attempts: 755,
            ..phase()
        };
        let more = Phase {
            attempts: 770,
            in_progress: 32,
            ..phase()
        };
        let note = attempts_note(&naive, &more);
        assert_lines_fit(&note);
        assert!(
            note.replace('\n', " ")
                .starts_with("Why idemstore needs more attempts (770 vs 755): its 32"),
            "{note}"
        );
        assert_eq!(
            attempts_note(&naive, &naive.clone()),
            "Both phases made 755 attempts."
        );
    }
}
