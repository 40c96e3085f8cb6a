//! When a failed delivery is tried again.

use std::time::Duration;

use crate::error::ConfigError;

use crate::store::LONGEST_DELAY as LONGEST;

/// Refuses a `value` of `setting` that becomes a time in the store (a retry delay, the park
/// delay, the lease, the retention window) beyond [`LONGEST`], saying what to do instead
/// (`instead`).
pub(crate) fn within_longest(
    setting: &'static str,
    value: Duration,
    instead: &str,
) -> Result<(), ConfigError> {
    if value <= LONGEST {
        return Ok(());
    }
    Err(ConfigError::InvalidSetting {
        setting,
        reason: format!(
            "{value:?} is more than 1000 years, further than a database can store a time; \
             {instead}"
        ),
    })
}

/// The delays between attempts of a delivery that failed with a transient error.
///
/// After the first failure the delivery waits `delays[0]`, after the second `delays[1]`, and so on;
/// when a failure finds no delay left, the delivery becomes a dead letter. The default is the
/// seed's schedule: 1 minute, 5 minutes, 15 minutes, 1 hour, 4 hours, 24 hours (seven attempts in
/// all).
///
/// ```
/// use std::time::Duration;
/// use outbox_core::RetryPolicy;
///
/// let policy = RetryPolicy::new([Duration::from_millis(10), Duration::from_millis(50)])?;
/// assert_eq!(policy.delay_after(1), Some(Duration::from_millis(10)));
/// assert_eq!(policy.delay_after(2), Some(Duration::from_millis(50)));
/// assert_eq!(policy.delay_after(3), None); // dead letter
/// # Ok::<(), outbox_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    delays: Vec<Duration>,
    jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        const MINUTE: u64 = 60;
        Self {
            delays: [1, 5, 15, 60, 4 * 60, 24 * 60]
                .map(|m| Duration::from_secs(m * MINUTE))
                .to_vec(),
            jitter: 0.0,
        }
    }
}

impl RetryPolicy {
    /// A policy with these delays and no jitter. An empty list means no retries: the first
    /// transient failure is a dead letter. At most 100 delays, each at most 1000 years.
    pub fn new(delays: impl IntoIterator<Item = Duration>) -> Result<Self, ConfigError> {
        let delays: Vec<Duration> = delays.into_iter().collect();
        if delays.len() > 100 {
            return Err(ConfigError::InvalidSetting {
                setting: "retry delays",
                reason: format!("{} delays given, at most 100 are allowed", delays.len()),
            });
        }
        for delay in &delays {
            within_longest(
                "retry delays",
                *delay,
                "to stop retrying, end the list there: the delivery is then a dead letter, \
                 which an operator requeues",
            )?;
        }
        Ok(Self {
            delays,
            jitter: 0.0,
        })
    }

    /// Spreads each delay randomly by up to `fraction` of itself either way (`0.1` gives
    /// 90%..110%), so that many deliveries failing together do not retry together.
    pub fn with_jitter(mut self, fraction: f64) -> Result<Self, ConfigError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(ConfigError::InvalidSetting {
                setting: "retry jitter",
                reason: format!("{fraction} is outside 0.0..=1.0"),
            });
        }
        self.jitter = fraction;
        Ok(self)
    }

    /// The delays, without jitter.
    pub fn delays(&self) -> &[Duration] {
        &self.delays
    }

    /// How long to wait after the `failures`-th failed attempt (counting from 1), or `None` when
    /// the delivery has used up its retries and is a dead letter.
    pub fn delay_after(&self, failures: u32) -> Option<Duration> {
        let index = usize::try_from(failures.checked_sub(1)?).ok()?;
        let delay = *self.delays.get(index)?;
        if self.jitter == 0.0 {
            return Some(delay);
        }
        let factor = 1.0 + self.jitter * (fastrand::f64() * 2.0 - 1.0);
        Some(Duration::try_from_secs_f64(delay.as_secs_f64() * factor).unwrap_or(delay))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delay_no_database_can_store_is_refused_with_what_to_do_instead() {
        let never = RetryPolicy::new([Duration::from_secs(60), Duration::MAX]).unwrap_err();
        assert_eq!(
            never.to_string(),
            format!(
                "invalid retry delays: {:?} is more than 1000 years, further than a database can \
                 store a time; to stop retrying, end the list there: the delivery is then a dead \
                 letter, which an operator requeues",
                Duration::MAX
            )
        );
        assert!(RetryPolicy::new([LONGEST]).is_ok());
    }

    #[test]
    fn default_schedule_is_the_seeds() {
        let minutes: Vec<u64> = RetryPolicy::default()
            .delays()
            .iter()
            .map(|d| d.as_secs() / 60)
            .collect();
        assert_eq!(minutes, [1, 5, 15, 60, 240, 1440]);
    }

    #[test]
    fn each_failure_takes_the_next_delay_until_none_is_left() {
        let policy = RetryPolicy::default();
        assert_eq!(policy.delay_after(0), None);
        assert_eq!(policy.delay_after(1), Some(Duration::from_secs(60)));
        assert_eq!(policy.delay_after(6), Some(Duration::from_secs(24 * 3600)));
        assert_eq!(policy.delay_after(7), None);
        assert_eq!(policy.delay_after(u32::MAX), None);
    }

    #[test]
    fn no_delays_means_the_first_failure_is_dead() {
        let policy = RetryPolicy::new([]).unwrap();
        assert_eq!(policy.delay_after(1), None);
    }

    #[test]
    fn jitter_stays_within_its_fraction() {
        let policy = RetryPolicy::new([Duration::from_secs(100)])
            .unwrap()
            .with_jitter(0.2)
            .unwrap();
        let delays: Vec<Duration> = (0..1000).map(|_| policy.delay_after(1).unwrap()).collect();
        assert!(
            delays
                .iter()
                .all(|d| (80.0..=120.0).contains(&d.as_secs_f64()))
        );
        // Not all equal: the jitter does spread them.
        assert!(delays.iter().any(|d| *d != delays[0]));
    }

    #[test]
    fn bad_settings_are_errors() {
        for fraction in [-0.1, 1.5, f64::NAN] {
            let error = RetryPolicy::default().with_jitter(fraction).unwrap_err();
            assert!(
                error.to_string().starts_with("invalid retry jitter"),
                "{error}"
            );
        }
        let error = RetryPolicy::new(vec![Duration::from_secs(1); 101]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid retry delays: 101 delays given, at most 100 are allowed"
        );
    }
}
