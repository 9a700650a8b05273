package relay

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// A latency on a bucket's bound counts in that bucket (le: less or equal),
// a negative one (clock skew) as 0, one above every bound only in +Inf.
func TestLatencyHistogramBuckets(t *testing.T) {
	var mu sync.Mutex
	h := &latencyHistogram{mu: &mu}
	for _, d := range []time.Duration{-time.Millisecond, 400 * time.Microsecond, 500 * time.Microsecond,
		501 * time.Microsecond, 3 * time.Second, 20 * time.Second} {
		h.observe(d)
	}
	want := `# HELP stagedrain_job_latency_seconds Time from a pushed job's created_at (its INSERT statement's start) to its push.
# TYPE stagedrain_job_latency_seconds histogram
stagedrain_job_latency_seconds_bucket{le="0.0005"} 3
stagedrain_job_latency_seconds_bucket{le="0.001"} 4
stagedrain_job_latency_seconds_bucket{le="0.002"} 4
stagedrain_job_latency_seconds_bucket{le="0.005"} 4
stagedrain_job_latency_seconds_bucket{le="0.01"} 4
stagedrain_job_latency_seconds_bucket{le="0.02"} 4
stagedrain_job_latency_seconds_bucket{le="0.05"} 4
stagedrain_job_latency_seconds_bucket{le="0.1"} 4
stagedrain_job_latency_seconds_bucket{le="0.2"} 4
stagedrain_job_latency_seconds_bucket{le="0.5"} 4
stagedrain_job_latency_seconds_bucket{le="1"} 4
stagedrain_job_latency_seconds_bucket{le="2"} 4
stagedrain_job_latency_seconds_bucket{le="5"} 5
stagedrain_job_latency_seconds_bucket{le="10"} 5
stagedrain_job_latency_seconds_bucket{le="+Inf"} 6
stagedrain_job_latency_seconds_sum 23.001401
stagedrain_job_latency_seconds_count 6
`
	if err := testutil.CollectAndCompare(h, strings.NewReader(want)); err != nil {
		t.Fatal(err)
	}
}
