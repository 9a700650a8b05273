package main

import (
	"context"
	"fmt"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// tracerProvider sets up the relay's tracing from OpenTelemetry's standard
// variables, read through getenv: only when OTEL_EXPORTER_OTLP_ENDPOINT or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set and OTEL_SDK_DISABLED is not
// "true" (and OTEL_TRACES_EXPORTER is not "none"). Then spans go over OTLP, by
// OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL: "http/protobuf" (the default) or
// "grpc"; the exporters read the rest (headers, timeout, TLS, ...), and the
// SDK reads OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_* and OTEL_SERVICE_NAME /
// OTEL_RESOURCE_ATTRIBUTES (the service name defaults to "stagedrain").
// Otherwise it returns nil: the relay makes no spans at all.
//
// shutdown flushes the spans still queued; call it when the relay stops.
func tracerProvider(ctx context.Context, getenv func(string) string) (tp *sdktrace.TracerProvider, shutdown func(context.Context) error, err error) {
	if strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return nil, nil, nil
	}
	if getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" {
		return nil, nil, nil
	}
	switch e := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")); e {
	case "", "otlp":
	case "none":
		return nil, nil, nil
	default:
		return nil, nil, usagef("run: OTEL_TRACES_EXPORTER %q: stagedrain exports traces over \"otlp\" only (or \"none\")", e)
	}
	protocol := getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if protocol == "" {
		protocol = getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	var exp sdktrace.SpanExporter
	switch strings.TrimSpace(protocol) {
	case "", "http/protobuf":
		exp, err = otlptracehttp.New(ctx)
	case "grpc":
		exp, err = otlptracegrpc.New(ctx)
	default:
		return nil, nil, usagef("run: OTEL_EXPORTER_OTLP_PROTOCOL %q: stagedrain exports traces over \"http/protobuf\" or \"grpc\"", protocol)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("run: set up the OTLP trace exporter: %w", err)
	}
	// Later options win: the environment's service name over the default.
	res, err := resource.New(ctx, resource.WithAttributes(attribute.String("service.name", "stagedrain")),
		resource.WithTelemetrySDK(), resource.WithFromEnv())
	if err != nil {
		return nil, nil, fmt.Errorf("run: tracing resource: %w", err)
	}
	tp = sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	return tp, tp.Shutdown, nil
}
