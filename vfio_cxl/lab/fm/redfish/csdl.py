"""The service's schema documents: ``$metadata``, the OData service document, and the CSDL of
``Oem.VfioCxl``.

``$metadata`` (Redfish DSP0266, "Service metadata") references, for every ``@odata.type`` the
service returns, DMTF's published CSDL file and both namespaces of it the type uses (the
unversioned one and the versioned one), so a client or a validator finds each definition
without guessing.  The lab's own properties (``Oem.VfioCxl``) get a small CSDL document of
their own, served by the service at ``SCHEMAS/VfioCxl_v1.xml``: an open complex type (its
members follow the FM's status and are described in docs/redfish.md).
"""

from __future__ import annotations

from xml.sax.saxutils import quoteattr

from .model import ROOT, TYPES

DMTF_SCHEMAS = "http://redfish.dmtf.org/schemas/v1"
SCHEMAS = f"{ROOT}/schemas"
OEM_SCHEMA = f"{SCHEMAS}/VfioCxl_v1.xml"
OEM_TYPE = "#VfioCxl.v1_0_0.VfioCxl"
# Resource collections the service returns ("#FabricCollection.FabricCollection", ...)
COLLECTIONS = ("Fabric", "Switch", "Port", "Endpoint", "Zone", "Connection", "EventDestination", "Session")
# The service document's top-level entries: (name, URL)
SINGLETONS = (("Service", f"{ROOT}/"), ("Fabrics", f"{ROOT}/Fabrics"), ("EventService", f"{ROOT}/EventService"),
              ("SessionService", f"{ROOT}/SessionService"))
EDMX = "http://docs.oasis-open.org/odata/ns/edmx"
EDM = "http://docs.oasis-open.org/odata/ns/edm"


def namespaces(odata_type: str) -> tuple[str, str, str]:
    """``#Fabric.v1_3_2.Fabric`` -> (file ``Fabric_v1.xml``, ``Fabric``, ``Fabric.v1_3_2``);
    a collection ``#FabricCollection.FabricCollection`` -> (``FabricCollection_v1.xml``, ``FabricCollection``, "")."""
    parts = odata_type.lstrip("#").split(".")
    if len(parts) == 2:
        return f"{parts[0]}_v1.xml", parts[0], ""
    return f"{parts[0]}_v1.xml", parts[0], ".".join(parts[:2])


def service_types() -> list[str]:
    """Every ``@odata.type`` the service can return (model.TYPES and the collections)."""
    return sorted({*TYPES.values(), *(f"#{k}Collection.{k}Collection" for k in COLLECTIONS)})


def metadata() -> str:
    """The CSDL ``$metadata`` document."""
    files: dict[str, set[str]] = {}
    for odata_type in service_types():
        file, unversioned, versioned = namespaces(odata_type)
        files.setdefault(file, set()).update(n for n in (unversioned, versioned) if n)
    files.setdefault("ServiceRoot_v1.xml", set()).add("ServiceRoot")
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             f'<edmx:Edmx xmlns:edmx="{EDMX}" Version="4.0">']
    for file in sorted(files):
        lines.append(f'  <edmx:Reference Uri={quoteattr(f"{DMTF_SCHEMAS}/{file}")}>')
        lines += [f'    <edmx:Include Namespace="{ns}"/>' for ns in sorted(files[file])]
        lines.append("  </edmx:Reference>")
    lines += [f'  <edmx:Reference Uri={quoteattr(f"{DMTF_SCHEMAS}/RedfishExtensions_v1.xml")}>',
              '    <edmx:Include Namespace="RedfishExtensions.v1_0_0" Alias="Redfish"/>',
              "  </edmx:Reference>",
              f"  <edmx:Reference Uri={quoteattr(OEM_SCHEMA)}>",
              '    <edmx:Include Namespace="VfioCxl"/>',
              '    <edmx:Include Namespace="VfioCxl.v1_0_0"/>',
              "  </edmx:Reference>",
              "  <edmx:DataServices>",
              f'    <Schema xmlns="{EDM}" Namespace="Service">',
              f'      <EntityContainer Name="Service" Extends="{TYPES["ServiceRoot"].lstrip("#").rsplit(".", 1)[0]}'
              '.ServiceContainer"/>',
              "    </Schema>",
              "  </edmx:DataServices>",
              "</edmx:Edmx>", ""]
    return "\n".join(lines)


def oem_schema() -> str:
    """CSDL of ``Oem.VfioCxl``: an open OEM object (Resource.OemObject)."""
    return "\n".join([
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<edmx:Edmx xmlns:edmx="{EDMX}" Version="4.0">',
        f'  <edmx:Reference Uri={quoteattr(f"{DMTF_SCHEMAS}/Resource_v1.xml")}>',
        '    <edmx:Include Namespace="Resource"/>',
        "  </edmx:Reference>",
        f'  <edmx:Reference Uri={quoteattr(f"{DMTF_SCHEMAS}/RedfishExtensions_v1.xml")}>',
        '    <edmx:Include Namespace="RedfishExtensions.v1_0_0" Alias="Redfish"/>',
        "  </edmx:Reference>",
        '  <edmx:Reference Uri="http://docs.oasis-open.org/odata/odata/v4.0/errata03/csd01/complete/vocabularies/'
        'Org.OData.Core.V1.xml">',
        '    <edmx:Include Namespace="Org.OData.Core.V1" Alias="OData"/>',
        "  </edmx:Reference>",
        "  <edmx:DataServices>",
        f'    <Schema xmlns="{EDM}" Namespace="VfioCxl">',
        '      <Annotation Term="Redfish.OwningEntity" String="vfio-cxl"/>',
        "    </Schema>",
        f'    <Schema xmlns="{EDM}" Namespace="VfioCxl.v1_0_0">',
        '      <ComplexType Name="VfioCxl" BaseType="Resource.OemObject">',
        '        <Annotation Term="OData.AdditionalProperties" Bool="true"/>',
        '        <Annotation Term="OData.Description" String="The lab\'s own properties of a resource: what the '
        'fabric manager knows about it (docs/redfish.md)."/>',
        "      </ComplexType>",
        "    </Schema>",
        "  </edmx:DataServices>",
        "</edmx:Edmx>", ""])


def service_document() -> dict:
    """The OData service document (``/redfish/v1/odata``)."""
    return {"@odata.context": f"{ROOT}/$metadata",
            "value": [{"name": name, "kind": "Singleton", "url": url} for name, url in SINGLETONS]}
