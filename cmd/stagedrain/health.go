package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"

	"github.com/stagedrain/stagedrain/relay"
)

// registerMetricsAddr declares --metrics-addr, shared by run and health.
// It is off by default: two relays on one host (a standby beside its
// leader, --queues groups) would fight over any fixed port, and 9187 is
// postgres_exporter's. The image turns it on (ENV STAGEDRAIN_METRICS_ADDR
// :9187 in cmd/stagedrain/Dockerfile), where the port is the container's
// own. Give it all interfaces (":9187"), as exporters bind, when the
// probes come from outside the container (the kubelet dials the pod's
// IP); the endpoints say nothing secret and change nothing.
func registerMetricsAddr(f *flagSet, addr *string) {
	f.fs.StringVar(addr, "metrics-addr", "",
		"`host:port` of the HTTP listener for /healthz, /readyz and /metrics, such as :9187; off when empty (the default) or off")
	f.env("metrics-addr", "STAGEDRAIN_METRICS_ADDR")
}

// metricsOff reports whether addr turns the HTTP listener off: empty (the
// default) or "off". An empty environment variable means "unset", so
// "off" is the way to turn off from the environment what an image turns on.
func metricsOff(addr string) bool { return addr == "" || addr == "off" }

// checkMetricsAddr checks that addr is an address to listen on, host:port
// or :port, before anything starts: a malformed one (a port alone, such
// as 9187) is a bad flag value, exit 2; an address that cannot be had
// (in use) fails later, exit 1.
func checkMetricsAddr(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err == nil && port == "" {
		err = errors.New("no port")
	}
	if err == nil {
		_, err = net.LookupPort("tcp", port)
	}
	if err != nil {
		var ae *net.AddrError
		if errors.As(err, &ae) {
			err = errors.New(ae.Err)
		}
		return fmt.Errorf("%q is not host:port (%v): want :9187 (every address) or 127.0.0.1:9187", addr, err)
	}
	return nil
}

// listenMetrics opens run's HTTP listener on addr. An address another
// process holds fails with one line saying what to do about it.
func listenMetrics(f *flagSet, addr string) (net.Listener, error) {
	l, err := net.Listen("tcp", addr)
	if err == nil {
		return l, nil
	}
	from := ""
	if f.fromEnv["metrics-addr"] {
		from = " (from $" + f.envs["metrics-addr"] + ")"
	}
	if errors.Is(err, syscall.EADDRINUSE) {
		return nil, fmt.Errorf("run: --metrics-addr %s%s: address already in use (another relay or exporter on this host has it); "+
			"give each relay its own --metrics-addr, or leave it unset (off)", addr, from)
	}
	return nil, fmt.Errorf("run: --metrics-addr %s%s: %w", addr, from, err)
}

// healthServer is run's HTTP listener.
type healthServer struct {
	r   *relay.Relay
	log *zap.Logger
}

func (h healthServer) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", h.readyz)
	mux.Handle("GET /metrics", h.metrics())
	return mux
}

// metrics serves the relay's metrics (relay.MetricsHandler's) with the Go
// runtime's (go_*) and the process's (process_*), from a registry of this
// listener's own.
func (h healthServer) metrics() http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return promhttp.HandlerFor(prometheus.Gatherers{h.r.MetricsGatherer(), reg}, promhttp.HandlerOpts{
		ErrorLog:      zap.NewStdLog(h.log.Named("metrics")),
		ErrorHandling: promhttp.ContinueOnError, // serve what was gathered
	})
}

// readyBody is /readyz's JSON body.
type readyBody struct {
	Ready     bool       `json:"ready"`
	Reason    string     `json:"reason,omitempty"` // why not ready
	Role      relay.Role `json:"role"`
	Since     time.Time  `json:"since"`
	LastDrain *time.Time `json:"last_drain,omitempty"`
	LastError string     `json:"last_error,omitempty"`
	// Paused lists the queues backpressure pauses ("*": every queue, for
	// Redis's memory); the relay stays ready.
	Paused []pausedQueue `json:"paused,omitempty"`
	// Schemas, for run --schemas, is each schema found with its own role
	// (role above is the process's: leader while it leads any).
	Schemas []schemaReady `json:"schemas,omitempty"`
}

type schemaReady struct {
	Schema    string        `json:"schema"`
	Role      relay.Role    `json:"role"`
	Since     time.Time     `json:"since"`
	LastDrain *time.Time    `json:"last_drain,omitempty"`
	LastError string        `json:"last_error,omitempty"`
	Paused    []pausedQueue `json:"paused,omitempty"`
}

type pausedQueue struct {
	Queue  string `json:"queue"`
	Reason string `json:"reason"`
}

// readyz answers 200 when the relay is ready (relay.CheckReady), 503 when
// not, with a JSON body saying which and why.
func (h healthServer) readyz(w http.ResponseWriter, req *http.Request) {
	ctx, cancel := context.WithTimeout(req.Context(), 3*time.Second)
	defer cancel()
	err := h.r.CheckReady(ctx)
	st := h.r.Status()
	body := readyBody{Ready: err == nil, Role: st.Role, Since: st.Since.UTC(), LastError: st.LastError}
	for _, p := range st.Paused {
		body.Paused = append(body.Paused, pausedQueue{Queue: p.Queue, Reason: p.Reason})
	}
	body.LastDrain = utcOrNil(st.LastDrain)
	for _, s := range st.Schemas {
		sr := schemaReady{Schema: s.Schema, Role: s.Role, Since: s.Since.UTC(), LastDrain: utcOrNil(s.LastDrain), LastError: s.LastError}
		for _, p := range s.Paused {
			sr.Paused = append(sr.Paused, pausedQueue{Queue: p.Queue, Reason: p.Reason})
		}
		body.Schemas = append(body.Schemas, sr)
	}
	code := http.StatusOK
	if err != nil {
		body.Reason = strings.TrimPrefix(err.Error(), relay.ErrNotReady.Error()+": ")
		code = http.StatusServiceUnavailable
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(body)
}

// utcOrNil is t in UTC, or nil for the zero time.
func utcOrNil(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	t = t.UTC()
	return &t
}

// runRelay runs r until ctx ends, with the HTTP listener on l when l is not
// nil; the listener is shut down once r.Run returns.
func runRelay(ctx context.Context, r *relay.Relay, l net.Listener, log *zap.Logger) error {
	if l == nil {
		return r.Run(ctx)
	}
	srv := &http.Server{
		Handler:           healthServer{r: r, log: log}.handler(),
		ReadHeaderTimeout: 5 * time.Second,
		ErrorLog:          zap.NewStdLog(log.Named("http")),
	}
	log.Info("http listening", zap.String("addr", l.Addr().String()))
	var g errgroup.Group
	g.Go(func() error {
		if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("http: %w", err)
		}
		return nil
	})
	runErr := r.Run(ctx)
	if err := withTimeout(ctx, 5*time.Second, srv.Shutdown); err != nil {
		_ = srv.Close() // a probe still in flight after 5s
	}
	return errors.Join(runErr, g.Wait())
}

func withTimeout(ctx context.Context, d time.Duration, f func(context.Context) error) error {
	c, cancel := context.WithTimeout(context.WithoutCancel(ctx), d)
	defer cancel()
	return f(c)
}

// newHealthFlags declares health's flags.
func newHealthFlags() (*flagSet, *string) {
	f := newFlagSet("health", "Exit 0 if the relay of this host answers GET /readyz with 200, else 1 with one\n"+
		"line saying why: a healthcheck for an image without a shell or curl.")
	addr := new(string)
	registerMetricsAddr(f, addr)
	return f, addr
}

func healthCmd(ctx context.Context, args []string, stdout io.Writer) error {
	f, addr := newHealthFlags()
	if err := f.parse(args, stdout); err != nil {
		return err
	}
	if metricsOff(*addr) {
		return usagef("health: %s is off: no /readyz to ask; set --metrics-addr (or $STAGEDRAIN_METRICS_ADDR) to the address of run's listener, which run opens only when given one", f.source("metrics-addr"))
	}
	if err := checkMetricsAddr(*addr); err != nil {
		return usagef("health: %s %s", f.source("metrics-addr"), err)
	}
	url, err := readyzURL(*addr)
	if err != nil {
		return usagef("health: %s: %s", f.source("metrics-addr"), err)
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("health: %w", err)
	}
	// One request: no connection kept for later.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("health: %w", err)
	}
	defer resp.Body.Close()
	var body readyBody
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode != http.StatusOK {
		reason := strings.TrimSpace(string(raw))
		if json.Unmarshal(raw, &body) == nil && body.Reason != "" {
			reason = body.Reason
		}
		return fmt.Errorf("health: not ready (%s): %s", resp.Status, reason)
	}
	role := "ready"
	if json.Unmarshal(raw, &body) == nil && body.Role != "" {
		role = string(body.Role)
	}
	fmt.Fprintf(stdout, "ready: %s\n", role)
	return nil
}

// readyzURL is the URL of /readyz on the listener at addr, with a host
// that means "every interface" (none, 0.0.0.0, ::) asked on loopback.
func readyzURL(addr string) (string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", err
	}
	switch host {
	case "", "0.0.0.0", "::":
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port) + "/readyz", nil
}
