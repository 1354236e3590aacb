"""/api/schema/: the OpenAPI document. drf-spectacular serves it as
``application/vnd.oai.openapi``, which browsers download rather than show; a
browser (Accept: text/html) gets the same YAML as a plain page instead, and
tools get YAML or JSON exactly as before (content negotiation picks the
most specific type the client accepts, so ``*/*`` still means YAML)."""

from __future__ import annotations

from django.utils.html import escape
from drf_spectacular.renderers import OpenApiJsonRenderer, OpenApiJsonRenderer2, OpenApiYamlRenderer, OpenApiYamlRenderer2
from drf_spectacular.views import SpectacularAPIView


class OpenApiYamlPageRenderer(OpenApiYamlRenderer):
    """The YAML schema inside a minimal HTML page, for reading in a browser."""

    media_type = "text/html"
    format = "html"
    charset = "utf-8"

    def render(self, data, media_type=None, renderer_context=None):
        yaml_text = super().render(data, media_type, renderer_context).decode("utf-8")
        return (
            '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Sluice OpenAPI schema</title></head>'
            '<body><p><a href="/api/docs/">Read it as API docs</a> · <a href="?format=openapi">download YAML</a> · '
            f'<a href="?format=openapi-json">JSON</a></p><pre>{escape(yaml_text)}</pre></body></html>'
        ).encode("utf-8")


class SchemaView(SpectacularAPIView):
    renderer_classes = [OpenApiYamlRenderer, OpenApiYamlRenderer2, OpenApiJsonRenderer, OpenApiJsonRenderer2,
                        OpenApiYamlPageRenderer]
